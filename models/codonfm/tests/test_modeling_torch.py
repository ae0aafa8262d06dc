"""What only Encodon has, on the torch backend against the reference (float32, CPU): hidden states, the padded
vocabulary, dropout in training only, the float32 rotary table, the MLM head on labelled codons only, and the
sequence-classification head (pooling by hand, BSHD = THD, each loss type, loading from an MLM export). Logits, loss,
gradients and packing against the reference are in the model contract (test_model_contract.py)."""

import pytest
import torch
import torch.nn.functional as F
from codonfm_testing import TINY_SHAPE, make_batch, reference_model, reference_to_nv
from model_contract import pack
from transformers import AutoModelForSequenceClassification

from codonfm_te.export import save_nv_checkpoint
from codonfm_te.modeling_codonfm_te import (
    NVEncodonConfig,
    NVEncodonForSequenceClassification,
    NVEncodonModel,
    sequence_means,
)
from codonfm_te.packing import pack_inputs


TOLERANCE = 1e-4


def test_hidden_states_match_the_reference(reference_tiny):
    nv_model = reference_to_nv(reference_tiny, backend="torch").eval()
    batch = make_batch([21, 9])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference_tiny(**batch).last_hidden_state
        outputs = nv_model(**batch, output_hidden_states=True)
        encoder = nv_model.encodon(batch["input_ids"], attention_mask=batch["attention_mask"])
    assert isinstance(nv_model.encodon, NVEncodonModel)
    assert (encoder.last_hidden_state[real] - expected[real]).abs().max() <= TOLERANCE
    # The embedding output, then every layer's output; the last is what the head reads.
    assert len(outputs.hidden_states) == reference_tiny.config.num_hidden_layers + 1
    assert torch.equal(outputs.hidden_states[-1], encoder.last_hidden_state)
    with torch.no_grad():
        embedded = reference_tiny.embeddings(batch["input_ids"])
    assert (outputs.hidden_states[0][real] - embedded[real]).abs().max() <= TOLERANCE


def test_padded_vocabulary_never_reaches_outputs(reference_tiny):
    nv_model = reference_to_nv(reference_tiny, backend="torch")
    assert nv_model.config.padded_vocab_size == 128
    assert nv_model.lm_head.decoder.weight.shape[0] == 128
    out = nv_model(**make_batch([10]))
    assert out.logits.shape[-1] == 69
    out.loss.backward()
    assert torch.count_nonzero(nv_model.lm_head.decoder.weight.grad[69:]) == 0
    assert torch.count_nonzero(nv_model.lm_head.decoder.bias.grad[69:]) == 0
    # The padding codon's embedding row gets no gradient either (padding_idx, as published).
    assert torch.count_nonzero(nv_model.encodon.embeddings.word_embeddings.weight.grad[3]) == 0


def test_dropout_is_active_in_training_only():
    reference = reference_model(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    nv_model = reference_to_nv(reference, backend="torch")
    assert nv_model.config.hidden_dropout_prob == 0.1 and nv_model.config.attention_probs_dropout_prob == 0.1
    batch = make_batch([20, 11])
    real = batch["attention_mask"].bool()
    nv_model.eval()
    with torch.no_grad():
        assert (nv_model(**batch).logits[real] - reference(**batch).logits[real]).abs().max() <= TOLERANCE
    nv_model.train()
    with torch.no_grad():
        assert not torch.equal(nv_model(**batch).logits, nv_model(**batch).logits)


def test_rotary_table_stays_float32_in_a_bf16_model(reference_tiny):
    nv_model = reference_to_nv(reference_tiny, backend="torch").to(torch.bfloat16)
    rotary = nv_model.encodon.rotary_embeddings
    assert rotary.inv_freq.dtype == torch.bfloat16  # model.to() cast the buffer ...
    table = rotary(40)
    assert table.dtype == torch.float32  # ... but the angles are computed from float32 frequencies
    inv_freq = reference_tiny.layers[0].attention.rotary_emb.inv_freq
    assert torch.equal(table[:, 0, 0, :8], torch.outer(torch.arange(40.0), inv_freq))
    assert torch.isfinite(nv_model(**make_batch([30, 12])).loss)


# ---------------------------------------------------------------------------------------- sequence classification


def classifier_from(reference, num_labels: int, **config) -> NVEncodonForSequenceClassification:
    """A classification model whose encoder holds the reference's weights (its head: a fresh MAGNETO init)."""
    mlm = reference_to_nv(reference, backend="torch")
    values = {k: v for k, v in mlm.config.to_dict().items() if k not in ("id2label", "label2id")}
    model_config = NVEncodonConfig(**{**values, "num_labels": num_labels, **config})
    model = NVEncodonForSequenceClassification(model_config).eval()
    model.encodon.load_state_dict(mlm.encodon.state_dict())
    return model


def pooled_logits_by_hand(model, reference, batch) -> torch.Tensor:
    """Mean of the reference's last hidden state over each row's real tokens, then dense -> GELU -> dense."""
    with torch.no_grad():
        hidden = reference(batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        head = model.classifier
        return F.linear(
            F.gelu(F.linear(pooled, head.dense.weight, head.dense.bias)), head.out_proj.weight, head.out_proj.bias
        )


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_classification_logits_are_the_mean_pooled_head(reference_tiny, layout):
    model = classifier_from(reference_tiny, num_labels=3)
    batch = make_batch([25, 7, 16], seed=2)
    expected = pooled_logits_by_hand(model, reference_tiny, batch)
    inputs = batch if layout == "bshd" else pack(batch)
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    assert logits.shape == (3, 3)
    assert (logits - expected).abs().max() <= TOLERANCE


def test_each_loss_type_is_the_hugging_face_one(reference_tiny):
    batch = make_batch([25, 7, 16], seed=2)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    cases = {
        # (num_labels, problem_type, labels) -> the loss on the logits
        "regression": (1, None, torch.tensor([0.5, -1.0, 2.0]), lambda z, y: F.mse_loss(z[:, 0], y)),
        "single_label": (3, None, torch.tensor([2, 0, 1]), F.cross_entropy),
        "multi_label": (
            3,
            None,
            torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]),
            F.binary_cross_entropy_with_logits,
        ),
        "regression_of_two": (2, "regression", torch.randn(3, 2), F.mse_loss),
    }
    for case, (num_labels, problem_type, labels, loss_fn) in cases.items():
        model = classifier_from(reference_tiny, num_labels=num_labels, problem_type=problem_type)
        with torch.no_grad():
            out = model(**inputs, labels=labels)
        expected = loss_fn(pooled_logits_by_hand(model, reference_tiny, batch), labels)
        assert abs(out.loss.item() - expected.item()) <= TOLERANCE, case


def test_classification_bshd_equals_thd_with_gradients(reference_tiny):
    batch = make_batch([25, 7, 16], seed=2)
    labels = torch.tensor([2, 0, 1])
    outputs, grads = {}, {}
    for layout in ("bshd", "thd"):
        torch.manual_seed(0)  # the same head weights in both models
        model = classifier_from(reference_tiny, num_labels=3)
        inputs = batch if layout == "bshd" else pack(batch)
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        outputs[layout] = model(**inputs, labels=labels)
        outputs[layout].loss.backward()
        grads[layout] = {n: p.grad for n, p in model.named_parameters()}
    torch.testing.assert_close(outputs["thd"].logits, outputs["bshd"].logits, rtol=0, atol=1e-5)
    for name, grad in grads["bshd"].items():
        torch.testing.assert_close(grads["thd"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_labels_must_be_one_per_sequence(reference_tiny):
    model = classifier_from(reference_tiny, num_labels=3)
    batch = make_batch([10, 8])
    with pytest.raises(ValueError, match="labels has 20 rows for 2 sequences"):
        model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"].reshape(-1))


def test_pooling_leaves_the_alignment_padding_out():
    """FP8 pads the packed tokens with a pseudo-sequence (here to a multiple of 16); it is no sequence to pool."""
    input_ids = torch.tensor([[0, 5, 6, 1, 3, 3], [0, 7, 1, 3, 3, 3]])
    mask = (input_ids != 3).long()
    packed = pack_inputs(input_ids, mask, None, None, None, pad_token_id=3, align_to=16)
    assert packed.input_ids.shape[0] == 16 and packed.num_real_tokens == 7
    hidden = torch.randn(16, 4)
    pooled = sequence_means(hidden, packed)
    assert pooled.shape == (2, 4)
    torch.testing.assert_close(pooled, torch.stack([hidden[:4].mean(0), hidden[4:7].mean(0)]))


def test_a_classifier_loads_from_a_masked_lm_export(tmp_path, reference_tiny):
    """Fine-tuning starts from a pre-training export: the encoder's weights load, the head starts fresh (MAGNETO)."""
    mlm = reference_to_nv(reference_tiny, backend="torch")
    save_nv_checkpoint(mlm, tmp_path / "export")
    model = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "export", trust_remote_code=True, backend="torch", num_labels=4
    )
    assert type(model).__name__ == "NVEncodonForSequenceClassification"
    for name, value in mlm.encodon.state_dict().items():
        assert torch.equal(model.encodon.state_dict()[name], value), name
    head = model.classifier.out_proj
    assert head.weight.shape == (4, TINY_SHAPE["hidden_size"]) and torch.count_nonzero(head.bias) == 0
    assert 0 < head.weight.std().item() < 0.1  # drawn, not left empty
