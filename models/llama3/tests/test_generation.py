"""Generation on the torch backend against Hugging Face's ``LlamaForCausalLM.generate`` (float32, CPU)."""

import pytest
import torch
from llama_testing import PAD, make_batch
from transformers import DynamicCache

from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.modeling_llama_te import NVLlamaForCausalLM


NEW_TOKENS = 12


@pytest.fixture
def nv_tiny(hf_tiny) -> NVLlamaForCausalLM:
    return convert_llama_hf_to_te(hf_tiny, backend="torch").eval()


def _prompts(lengths=(9, 5, 7), seed=2):
    input_ids, attention_mask, _ = make_batch(list(lengths), seed=seed, padding_side="left")
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _generate(model, prompts, **kwargs):
    # eos_token_id=None: random weights would stop at different times only if they emitted <eos>; never stop early.
    return model.generate(**prompts, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, eos_token_id=None, **kwargs)


class _InputLengths:
    """Records the sequence length of every forward call of a model."""

    def __init__(self, model):
        self.lengths = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        self.lengths.append(input_ids.shape[-1])


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_greedy_left_padded_batch_equals_hugging_face(hf_tiny, nv_tiny, use_cache):
    prompts = _prompts()
    expected = _generate(hf_tiny, prompts, do_sample=False, use_cache=use_cache)
    recorder = _InputLengths(nv_tiny)
    actual = _generate(nv_tiny, prompts, do_sample=False, use_cache=use_cache)
    assert actual.shape == (3, 9 + NEW_TOKENS)
    assert torch.equal(actual, expected)
    # With a cache only the prompt is run in full, then one token per step; without, the prefix grows.
    steps = recorder.lengths
    assert steps == ([9] + [1] * (NEW_TOKENS - 1) if use_cache else list(range(9, 9 + NEW_TOKENS)))


def test_batched_generation_equals_each_prompt_alone(nv_tiny):
    """Left padding does not change what a prompt generates (positions start at its first real token)."""
    prompts = _prompts()
    batched = _generate(nv_tiny, prompts, do_sample=False)
    for row in range(3):
        real = prompts["input_ids"][row][prompts["attention_mask"][row].bool()].unsqueeze(0)
        alone = _generate(nv_tiny, {"input_ids": real, "attention_mask": torch.ones_like(real)}, do_sample=False)
        assert torch.equal(batched[row, -NEW_TOKENS:], alone[0, -NEW_TOKENS:]), row


def test_sampling_equals_hugging_face_with_the_same_seed(hf_tiny, nv_tiny):
    prompts = _prompts()
    kwargs = {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95}
    torch.manual_seed(123)
    expected = _generate(hf_tiny, prompts, **kwargs)
    torch.manual_seed(123)
    actual = _generate(nv_tiny, prompts, **kwargs)
    assert torch.equal(actual, expected)
    torch.manual_seed(124)
    assert not torch.equal(_generate(nv_tiny, prompts, **kwargs), actual)  # it really samples


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_beam_search_equals_hugging_face(hf_tiny, nv_tiny, use_cache):
    prompts = _prompts()
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "do_sample": False, "use_cache": use_cache}
    expected = _generate(hf_tiny, prompts, **kwargs)
    actual = _generate(nv_tiny, prompts, **kwargs)
    assert actual.shape == (6, 9 + NEW_TOKENS)
    assert torch.equal(actual, expected)


def test_cached_forward_matches_the_full_forward(hf_tiny, nv_tiny):
    """Prefill + one-token steps through the cache give the logits of one full forward, token for token."""
    input_ids, attention_mask, _ = make_batch([14, 8], seed=5, padding_side="left")
    with torch.no_grad():
        full = nv_tiny(input_ids, attention_mask=attention_mask).logits
        cache = DynamicCache(config=nv_tiny.config)
        out = nv_tiny(input_ids[:, :10], attention_mask=attention_mask[:, :10], past_key_values=cache, use_cache=True)
        steps = [out.logits]
        for position in range(10, 14):
            out = nv_tiny(
                input_ids[:, position : position + 1],
                attention_mask=attention_mask[:, : position + 1],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            steps.append(out.logits)
    cached = torch.cat(steps, dim=1)
    real = attention_mask.bool()
    assert cache.get_seq_length() == 14
    assert (cached[real] - full[real]).abs().max() <= 1e-5
    assert torch.isfinite(cached).all()  # padding rows stay finite too
