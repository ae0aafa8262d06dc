"""Llama's own checks of the pure-PyTorch backend against the stock Hugging Face Llama (float32, CPU): rope bands,
shift_labels, left padding, the padded vocabulary. Logits, loss, gradients and packing against the stock model, for
MHA/GQA, both rope types, tied and untied, are in the model contract (test_model_contract.py)."""

import pytest
import torch
from llama_testing import (
    LLAMA3_ROPE,
    TINY_GQA_SHAPE,
    TINY_SHAPE,
    VOCAB_SIZE,
    hf_llama_config,
    make_batch,
    randomize_,
)
from model_contract import pack
from transformers import LlamaForCausalLM

from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.modeling_llama_te import NVLlamaConfig, rope_inverse_frequencies


TOLERANCE = 1e-4


def _paired_models(shape: dict, rope: dict | None = None, tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    hf_model = randomize_(LlamaForCausalLM(hf_llama_config(rope, tie_word_embeddings=tie, **shape)), seed).eval()
    return hf_model, convert_llama_hf_to_te(hf_model, backend="torch").eval()


def test_longer_sequences_exercise_the_llama3_frequency_bands():
    """Positions far beyond original_max_position_embeddings, where the three rope bands differ most."""
    hf_model, nv_model = _paired_models(TINY_GQA_SHAPE, LLAMA3_ROPE)
    input_ids, attention_mask, _ = make_batch([300])
    with torch.no_grad():
        expected = hf_model(input_ids).logits
        actual = nv_model(input_ids, attention_mask=attention_mask).logits
    assert (actual - expected).abs().max() <= TOLERANCE
    expected_inv_freq = hf_model.model.rotary_emb.inv_freq
    assert torch.allclose(nv_model.model.rotary_emb.inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
    plain = rope_inverse_frequencies(NVLlamaConfig(**{**TINY_GQA_SHAPE, "backend": "torch"}))
    assert not torch.allclose(plain, expected_inv_freq)  # the scaling really changed something


@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_shift_labels_equal_hugging_face_loss(hf_tiny, input_format):
    """Targets shifted by the caller (Hugging Face's ``shift_labels``) give HF's loss, in both layouts."""
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch").eval()
    input_ids, attention_mask, labels = make_batch([12, 30, 7], seed=5)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # right padding: -100 after the end
    with torch.no_grad():
        expected = hf_tiny(input_ids, attention_mask=attention_mask, labels=labels).loss
        if input_format == "bshd":
            loss = nv_model(input_ids, attention_mask=attention_mask, shift_labels=shifted).loss
        else:
            batch = pack({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
            batch["shift_labels"] = shifted[attention_mask.bool()][None]
            del batch["labels"]
            loss = nv_model(**batch).loss
    assert abs(loss.item() - expected.item()) <= TOLERANCE


def test_left_padded_sequences_equal_hugging_face_on_each_alone(hf_tiny):
    """Left padding (positions start at the first real token) gives, for every sequence, what HF gives for that
    sequence on its own. (Packed sequences: the model contract.)"""
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch").eval()
    lengths = [12, 30, 7]
    input_ids, attention_mask, _ = make_batch(lengths, seed=3, padding_side="left")
    with torch.no_grad():
        out = nv_model(input_ids, attention_mask=attention_mask).logits
        for row, length in enumerate(lengths):
            alone = hf_tiny(input_ids[row : row + 1, -length:]).logits[0]
            assert (out[row, -length:] - alone).abs().max() <= TOLERANCE, row


def test_padded_vocabulary_never_reaches_outputs():
    hf_model, nv_model = _paired_models(TINY_SHAPE, tie=True)
    assert nv_model.config.padded_vocab_size == VOCAB_SIZE  # 256 is already a multiple of 64
    config = NVLlamaConfig(**{**TINY_SHAPE, "vocab_size": 250, "backend": "torch"})
    assert config.padded_vocab_size == 256
    small = randomize_(LlamaForCausalLM(hf_llama_config(**{**TINY_SHAPE, "vocab_size": 250})))
    nv_small = convert_llama_hf_to_te(small, backend="torch")
    assert nv_small.model.embed_tokens.weight.shape[0] == 256
    input_ids, attention_mask, labels = make_batch([10])
    input_ids, labels = input_ids % 250, labels.clamp(max=249)
    out = nv_small(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.shape[-1] == 250
    out.loss.backward()
    assert torch.count_nonzero(nv_small.lm_head.weight.grad[250:]) == 0
