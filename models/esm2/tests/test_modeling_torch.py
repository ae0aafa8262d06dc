"""The pure-PyTorch backend against the stock Hugging Face ESM-2 (float32, CPU)."""

import pytest
import torch
from esm_testing import TINY_SHAPE, hf_esm2_config, make_batch, pack, randomize_, shape_of
from transformers import EsmForMaskedLM, EsmForTokenClassification

from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.modeling_esm_te import NVEsmConfig, NVEsmForTokenClassification
from esm2_te.torch_layers import context_parallel_positions


TOLERANCE = 1e-4


def _paired_models(shape: dict, seed: int = 0):
    torch.manual_seed(seed)
    hf_model = randomize_(EsmForMaskedLM(hf_esm2_config(**shape)), seed).eval()
    return hf_model, convert_esm_hf_to_te(hf_model, backend="torch").eval()


@pytest.mark.parametrize(
    "shape",
    [TINY_SHAPE, shape_of("esm2_t6_8M_UR50D"), shape_of("esm2_t12_35M_UR50D")],
    ids=["tiny", "8M", "35M"],
)
def test_logits_and_loss_match_hugging_face(shape):
    hf_model, nv_model = _paired_models(shape)
    input_ids, attention_mask, labels = make_batch([37, 20, 9])  # padding in rows 2 and 3, <mask> tokens everywhere
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask, labels=labels)
        actual = nv_model(input_ids, attention_mask=attention_mask, labels=labels)
    real = attention_mask.bool()  # HF's outputs at padding positions carry no meaning
    assert actual.logits.shape == expected.logits.shape == (3, 37, 33)
    assert (actual.logits[real] - expected.logits[real]).abs().max() <= TOLERANCE
    assert abs(actual.loss.item() - expected.loss.item()) <= TOLERANCE


def test_gradients_match_hugging_face(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    input_ids, attention_mask, labels = make_batch([30, 17])
    hf_tiny(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    nv_model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    hf_grads = dict(hf_tiny.named_parameters())
    nv_grads = dict(nv_model.named_parameters())
    pairs = {
        "esm.embeddings.word_embeddings.weight": "esm.embeddings.word_embeddings.weight",
        "esm.encoder.layer.1.intermediate.dense.weight": "esm.encoder.layers.1.layernorm_mlp.fc1_weight",
        "esm.encoder.layer.0.attention.output.dense.weight": "esm.encoder.layers.0.self_attention.proj.weight",
        "lm_head.dense.weight": "lm_head.dense.weight",
    }
    for hf_name, nv_name in pairs.items():
        expected, actual = hf_grads[hf_name].grad, nv_grads[nv_name].grad[: hf_grads[hf_name].shape[0]]
        assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-4), hf_name


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


def test_thd_equals_bshd_per_token(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch").eval()
    input_ids, attention_mask, labels = make_batch([25, 11, 40, 3])
    with torch.no_grad():
        bshd = nv_model(input_ids, attention_mask=attention_mask, labels=labels)
        thd = nv_model(**pack(input_ids, attention_mask, labels))
    assert thd.logits.shape == (1, int(attention_mask.sum()), 33)
    assert torch.allclose(thd.logits[0], bshd.logits[attention_mask.bool()], atol=1e-5)
    assert torch.allclose(thd.loss, bshd.loss, atol=1e-6)


def test_packed_sequences_do_not_see_each_other(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch").eval()
    input_ids, attention_mask, labels = make_batch([15, 22])
    batch = pack(input_ids, attention_mask, labels)
    with torch.no_grad():
        reference = nv_model(**batch).logits
        batch["input_ids"][0, 15:] = torch.randint(4, 24, (22,))  # rewrite the second sequence entirely
        changed = nv_model(**batch).logits
    assert torch.equal(reference[0, :15], changed[0, :15])
    assert not torch.allclose(reference[0, 15:], changed[0, 15:])


def test_thd_alone_matches_hugging_face_on_each_sequence(hf_tiny):
    """A packed batch gives, for every sequence, what HF gives for that sequence on its own."""
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch").eval()
    lengths = [12, 30, 7]
    input_ids, attention_mask, labels = make_batch(lengths, seed=3)
    with torch.no_grad():
        packed = nv_model(**pack(input_ids, attention_mask, labels)).logits[0]
        start = 0
        for row, length in enumerate(lengths):
            alone = hf_tiny(input_ids[row : row + 1, :length]).logits[0]
            assert (packed[start : start + length] - alone).abs().max() <= TOLERANCE
            start += length


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


def test_loss_without_labelled_tokens_is_zero_not_nan(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    input_ids, attention_mask, labels = make_batch([10])
    loss = nv_model(input_ids, attention_mask=attention_mask, labels=torch.full_like(labels, -100)).loss
    assert loss.item() == 0.0


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
