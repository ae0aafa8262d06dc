"""The pure-PyTorch backend against the stock Hugging Face Llama (float32, CPU)."""

import pytest
import torch
from llama_testing import (
    LLAMA3_ROPE,
    TINY_GQA_SHAPE,
    TINY_SHAPE,
    VOCAB_SIZE,
    hf_llama_config,
    make_batch,
    pack,
    randomize_,
)
from transformers import LlamaForCausalLM

from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.modeling_llama_te import NVLlamaConfig, rope_inverse_frequencies


TOLERANCE = 1e-4


def _paired_models(shape: dict, rope: dict | None = None, tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    hf_model = randomize_(LlamaForCausalLM(hf_llama_config(rope, tie_word_embeddings=tie, **shape)), seed).eval()
    return hf_model, convert_llama_hf_to_te(hf_model, backend="torch").eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["rope", "llama3-rope"])
@pytest.mark.parametrize("shape", [TINY_SHAPE, TINY_GQA_SHAPE], ids=["mha", "gqa"])
def test_logits_and_loss_match_hugging_face(shape, rope, tie):
    hf_model, nv_model = _paired_models(shape, rope, tie)
    assert (nv_model.lm_head.weight is nv_model.model.embed_tokens.weight) == tie
    input_ids, attention_mask, labels = make_batch([37, 20, 9])  # right padding in rows 2 and 3
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask, labels=labels)
        actual = nv_model(input_ids, attention_mask=attention_mask, labels=labels)
    real = attention_mask.bool()  # HF's outputs at padding positions carry no meaning
    assert actual.logits.shape == expected.logits.shape == (3, 37, VOCAB_SIZE)
    assert (actual.logits[real] - expected.logits[real]).abs().max() <= TOLERANCE
    assert abs(actual.loss.item() - expected.loss.item()) <= TOLERANCE


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


def test_gradients_match_hugging_face(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    input_ids, attention_mask, labels = make_batch([30, 17])
    hf_tiny(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    nv_model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    hf_params, nv_params = dict(hf_tiny.named_parameters()), dict(nv_model.named_parameters())
    pairs = {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.1.mlp.down_proj.weight": "model.layers.1.layernorm_mlp.fc2_weight",
        "model.layers.0.self_attn.o_proj.weight": "model.layers.0.self_attention.proj.weight",
        "model.layers.0.input_layernorm.weight": "model.layers.0.self_attention.layernorm_qkv.layer_norm_weight",
        "lm_head.weight": "lm_head.weight",
    }
    for hf_name, nv_name in pairs.items():
        expected = hf_params[hf_name].grad
        actual = nv_params[nv_name].grad[: expected.shape[0]]
        assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-4), hf_name
    # The fused QKV gradient, split back, equals HF's per-projection gradients.
    from llama3_te.convert import split_qkv

    fused = nv_params["model.layers.1.self_attention.layernorm_qkv.weight"].grad
    q, k, v = split_qkv(fused, 4, 2, 16)
    for name, grad in zip("qkv", (q, k, v)):
        assert torch.allclose(grad, hf_params[f"model.layers.1.self_attn.{name}_proj.weight"].grad, atol=1e-5), name


def test_thd_equals_bshd_per_token(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch").eval()
    input_ids, attention_mask, labels = make_batch([25, 11, 40, 3])
    with torch.no_grad():
        bshd = nv_model(input_ids, attention_mask=attention_mask, labels=labels)
        thd = nv_model(**pack(input_ids, attention_mask, labels))
    assert thd.logits.shape == (1, int(attention_mask.sum()), VOCAB_SIZE)
    assert torch.allclose(thd.logits[0], bshd.logits[attention_mask.bool()], atol=1e-5)
    assert torch.allclose(thd.loss, bshd.loss, atol=1e-6)


def test_packed_loss_does_not_predict_across_sequence_boundaries(hf_tiny):
    """The packed loss equals the mean of HF's per-token losses computed on each sequence alone."""
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch").eval()
    lengths = [12, 30, 7]
    input_ids, attention_mask, labels = make_batch(lengths, seed=4)
    total, count = 0.0, 0
    with torch.no_grad():
        for row, length in enumerate(lengths):
            alone = hf_tiny(input_ids[row : row + 1, :length], labels=labels[row : row + 1, :length]).loss
            total, count = total + alone.item() * (length - 1), count + length - 1
        packed = nv_model(**pack(input_ids, attention_mask, labels)).loss
    assert abs(packed.item() - total / count) <= TOLERANCE


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
            batch = pack(input_ids, attention_mask, labels)
            batch["shift_labels"] = shifted[attention_mask.bool()][None]
            del batch["labels"]
            loss = nv_model(**batch).loss
    assert abs(loss.item() - expected.item()) <= TOLERANCE


@pytest.mark.parametrize("input_format", ["left-padded", "thd"])
def test_each_sequence_equals_hugging_face_on_it_alone(hf_tiny, input_format):
    """Left padding (positions start at the first real token) and packing both give, for every sequence, what
    HF gives for that sequence on its own."""
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch").eval()
    lengths = [12, 30, 7]
    side = "left" if input_format == "left-padded" else "right"
    input_ids, attention_mask, labels = make_batch(lengths, seed=3, padding_side=side)
    with torch.no_grad():
        if input_format == "thd":
            out = nv_model(**pack(input_ids, attention_mask, labels)).logits[0]
            per_sequence = out.split(lengths)
        else:
            out = nv_model(input_ids, attention_mask=attention_mask).logits
            per_sequence = [out[row, -length:] for row, length in enumerate(lengths)]
        for row in range(len(lengths)):
            real = input_ids[row][attention_mask[row].bool()]
            alone = hf_tiny(real.unsqueeze(0)).logits[0]
            assert (per_sequence[row] - alone).abs().max() <= TOLERANCE, row


def test_packed_sequences_do_not_see_each_other(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch").eval()
    input_ids, attention_mask, labels = make_batch([15, 22])
    batch = pack(input_ids, attention_mask, labels)
    with torch.no_grad():
        reference = nv_model(**batch).logits
        batch["input_ids"][0, :15] = torch.randint(5, VOCAB_SIZE, (15,))  # rewrite the first sequence entirely
        changed = nv_model(**batch).logits
    assert torch.equal(reference[0, 15:], changed[0, 15:])
    assert not torch.allclose(reference[0, :15], changed[0, :15])


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


def test_loss_without_labelled_tokens_is_zero_not_nan(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    input_ids, attention_mask, labels = make_batch([10])
    loss = nv_model(input_ids, attention_mask=attention_mask, labels=torch.full_like(labels, -100)).loss
    assert loss.item() == 0.0
