"""Generation with the KV cache on the TransformerEngine backend, on a GPU (run on the GPU machine).

TE against the torch backend (state-dict keys, bf16 forward and backward, FP8, export, meta init) is in the model
contract (test_model_contract.py); the torch backend's generation against Hugging Face is in test_generation.py.
"""

import pytest
import torch
from llama_testing import PAD, make_batch
from model_contract_te import relative_error, torch_and_te_models
from test_model_contract import CONTRACTS
from transformers.cache_utils import DynamicCache


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]


def _torch_and_te_models(dtype: torch.dtype):
    """The untied contract's TE-sized model (GQA, Llama 3 rope) on both backends."""
    contract = CONTRACTS["llama3-untied"]
    return torch_and_te_models(contract, contract.te_hf_model(), dtype)


def _generate(model, prompts: dict, **kwargs) -> torch.Tensor:
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    with torch.no_grad():
        return model.generate(**prompts, **kwargs)


def _left_padded_prompts() -> dict:
    input_ids, attention_mask, _ = make_batch([40, 17, 29], seed=7, padding_side="left")
    return {"input_ids": input_ids.cuda(), "attention_mask": attention_mask.cuda()}


def test_te_kv_cache_generation_equals_torch_backend_greedy_in_fp32(monkeypatch):
    """Cached decoding with TE's sub-modules (fused RMSNorm+QKV GEMM, projection, MLP) chooses the torch backend's
    tokens, and the tokens of TE recomputing the whole prefix (use_cache=False), one for one in float32."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means float32 here
    torch_model, te_model = _torch_and_te_models(dtype=torch.float32)
    prompts = _left_padded_prompts()
    te_cached = _generate(te_model, prompts)
    assert te_cached.shape == (3, 40 + 24)
    assert torch.equal(te_cached, _generate(torch_model, prompts))
    assert torch.equal(te_cached, _generate(te_model, prompts, use_cache=False))
    assert _generate(te_model, prompts, num_beams=3).shape == (3, 40 + 24)


# bf16 logits of this model are ~2-4 in size, where one bf16 step (ulp) is 1/64; the cached and the full forward
# round differently (SDPA over the cache vs TE's fused attention) and differ by up to 4 steps (0.0625 measured on an
# H100; TE's and the torch backend's full forwards differ by up to 0.098). Two logits closer than twice that are a
# near tie that rounding may break either way.
BF16_NEAR_TIE = 0.125


def test_te_bf16_cached_greedy_agrees_with_full_forward_greedy():
    """In bf16, greedy decoding through the cache and by recomputing the prefix (use_cache=False) choose the same
    tokens until a near tie: where a row first differs, the cached choice is within BF16_NEAR_TIE of the best logit
    of the full forward that chose the other token."""
    _, te_model = _torch_and_te_models(dtype=torch.bfloat16)
    prompts = _left_padded_prompts()
    cached, recomputed = _generate(te_model, prompts), _generate(te_model, prompts, use_cache=False)
    mask = torch.cat([prompts["attention_mask"], torch.ones_like(recomputed[:, 40:])], dim=1)
    for row in range(cached.shape[0]):
        differ = (cached[row] != recomputed[row]).nonzero()
        if len(differ) == 0:
            continue
        step = int(differ[0])
        with torch.no_grad():  # the forward use_cache=False ran for this step (the whole batch, as generate does)
            logits = te_model(recomputed[:, :step], attention_mask=mask[:, :step]).logits[row, -1].float()
        assert int(logits.argmax()) == int(recomputed[row, step]), (row, step)
        gap = (logits.max() - logits[cached[row, step]]).item()
        assert gap <= BF16_NEAR_TIE, f"row {row}, step {step}: the cached choice is {gap} below the best, no near tie"


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)],  # bf16: the tolerance TE is held to against the torch backend
    ids=["fp32", "bf16"],
)
def test_te_cached_forward_matches_the_full_forward(dtype, tolerance, monkeypatch):
    """Prefill + one-token steps through the cache on TE give, step by step, the logits of one full TE forward
    (teacher-forced: both see the same tokens)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _, te_model = _torch_and_te_models(dtype=dtype)
    input_ids, attention_mask, _ = make_batch([60, 41], seed=3, padding_side="left")
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    prefill = 40
    with torch.no_grad():
        full = te_model(input_ids, attention_mask=attention_mask).logits.float()
        cache = DynamicCache(config=te_model.config)
        steps = [te_model(input_ids[:, :prefill], attention_mask=attention_mask[:, :prefill], past_key_values=cache)]
        for t in range(prefill, input_ids.shape[1]):
            steps.append(
                te_model(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1], past_key_values=cache)
            )
    cached = torch.cat([step.logits.float() for step in steps], dim=1)
    real = attention_mask.bool()
    assert relative_error(cached[:, :prefill][real[:, :prefill]], full[:, :prefill][real[:, :prefill]]) < tolerance
    for t in range(prefill, input_ids.shape[1]):
        assert relative_error(cached[:, t], full[:, t]) < tolerance, f"decoding step at position {t}"
