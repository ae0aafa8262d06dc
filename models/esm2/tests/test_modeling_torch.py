"""ESM-2's own checks of the pure-PyTorch backend (float32, CPU): token dropout, the padded vocabulary, token
classification against Hugging Face, and the context-parallel split. Logits, loss, gradients and packing against the
stock model are in the model contract (test_model_contract.py)."""

import pytest
import torch
from esm_testing import TINY_SHAPE, hf_esm2_config, make_batch, randomize_
from transformers import EsmForMaskedLM, EsmForTokenClassification

from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.modeling_esm_te import NVEsmConfig, NVEsmForTokenClassification
from esm2_te.torch_layers import context_parallel_positions


TOLERANCE = 1e-4


def test_token_dropout_rescaling_depends_on_each_sequence_own_mask_ratio(hf_tiny):
    """A <mask> in one sequence must not change another sequence's embedding scale (per-sequence ratio)."""
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch").eval()
    input_ids, attention_mask, _ = make_batch([20, 20], mask_fraction=0.0)
    changed = input_ids.clone()
    changed[1, 3:8] = 32  # more masks in sequence 2 only
    with torch.no_grad():
        before = nv_model(input_ids, attention_mask=attention_mask).logits
        after = nv_model(changed, attention_mask=attention_mask).logits
    assert torch.equal(before[0], after[0])
    assert not torch.allclose(before[1], after[1])


def test_padded_vocabulary_never_reaches_outputs(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    assert nv_model.config.padded_vocab_size == 64
    assert nv_model.esm.embeddings.word_embeddings.weight.shape[0] == 64
    input_ids, attention_mask, labels = make_batch([10])
    out = nv_model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.shape[-1] == 33
    out.loss.backward()
    # The padded rows of the tied embedding/decoder get no gradient: no logit ever came from them.
    assert torch.count_nonzero(nv_model.esm.embeddings.word_embeddings.weight.grad[33:]) == 0


def test_token_classification_matches_hugging_face():
    """NVEsmForTokenClassification against HF's EsmForTokenClassification holding the same encoder and classifier."""
    torch.manual_seed(0)
    hf_classifier = randomize_(EsmForTokenClassification(hf_esm2_config(**TINY_SHAPE, num_labels=3))).eval()
    hf_masked_lm = EsmForMaskedLM(hf_esm2_config(**TINY_SHAPE))
    hf_masked_lm.esm.load_state_dict(hf_classifier.esm.state_dict())
    encoder = convert_esm_hf_to_te(hf_masked_lm, backend="torch").esm
    nv_classifier = NVEsmForTokenClassification(NVEsmConfig(**{**encoder.config.to_dict(), "num_labels": 3})).eval()
    nv_classifier.esm.load_state_dict(encoder.state_dict())
    nv_classifier.classifier.load_state_dict(hf_classifier.classifier.state_dict())

    input_ids, attention_mask, _ = make_batch([21, 9])
    labels = torch.where(attention_mask.bool(), torch.randint(0, 3, input_ids.shape), -100)
    with torch.no_grad():
        expected = hf_classifier(input_ids, attention_mask=attention_mask, labels=labels)
        actual = nv_classifier(input_ids, attention_mask=attention_mask, labels=labels)
    real = attention_mask.bool()
    assert (actual.logits[real] - expected.logits[real]).abs().max() <= TOLERANCE
    assert abs(actual.loss.item() - expected.loss.item()) <= TOLERANCE


@pytest.mark.parametrize(
    ("padded_lengths", "cp_size", "expected"),
    [
        # One sequence of 8 over 2 ranks: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
        ([8], 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        # Two sequences (8 and 4): positions restart in each sequence.
        ([8, 4], 2, [[0, 1, 6, 7, 0, 3], [2, 3, 4, 5, 1, 2]]),
        # 4 ranks, one sequence of 8: chunks of 1; rank r holds positions r and 7 - r.
        ([8], 4, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_context_parallel_positions_follow_the_load_balanced_split(padded_lengths, cp_size, expected):
    cu = torch.tensor([0, *torch.tensor(padded_lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert [context_parallel_positions(cu, cp_size, rank).tolist() for rank in range(cp_size)] == expected
