"""The TransformerEngine backend against the pure-PyTorch backend, on a GPU (run on the GPU machine).

The torch backend is pinned to Hugging Face on CPU (test_modeling_torch.py); these tests pin TE to it.
"""

import pytest
import torch
from llama_testing import (
    LLAMA3_ROPE,
    MODEL_CONFIGS,
    PAD,
    TINY_GQA_SHAPE,
    hf_llama_config,
    make_batch,
    pack,
    randomize_,
    shape_of,
)
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.export import export_hf_checkpoint
from llama3_te.modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]

# Wide enough for TE's fused kernels to be the ones that run (head_dim 64), small enough to be quick.
SHAPE = {**shape_of("llama3-tiny-nucleotide"), "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
NUM_LAYERS = SHAPE["num_hidden_layers"]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _torch_and_te_models(shape=SHAPE, dtype=torch.bfloat16, rope=LLAMA3_ROPE, tie=False, **config_overrides):
    torch.manual_seed(0)
    hf_model = randomize_(LlamaForCausalLM(hf_llama_config(rope, tie_word_embeddings=tie, **shape)))
    torch_model = convert_llama_hf_to_te(hf_model, backend="torch", **config_overrides)
    te_model = NVLlamaForCausalLM(NVLlamaConfig(**{**torch_model.config.to_dict(), "backend": "te"}))
    te_model.load_state_dict(torch_model.state_dict(), strict=True)  # identical keys, both directions
    return torch_model.to("cuda", dtype), te_model.to("cuda", dtype)


def _cuda(batch: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_state_dict_keys_are_identical_between_backends(tie):
    torch_model, te_model = _torch_and_te_models(TINY_GQA_SHAPE, tie=tie)
    assert te_model.backend == "te" and torch_model.backend == "torch"
    assert set(te_model.state_dict()) == set(torch_model.state_dict())
    torch_model.load_state_dict(te_model.state_dict(), strict=True)
    assert (te_model.lm_head.weight is te_model.model.embed_tokens.weight) == tie


@pytest.mark.parametrize("input_format", ["bshd-right", "bshd-left", "thd"])
def test_te_matches_torch_in_bf16_forward_and_backward(input_format):
    torch_model, te_model = _torch_and_te_models()
    side = "left" if input_format == "bshd-left" else "right"
    input_ids, attention_mask, labels = make_batch([200, 130, 77, 250], padding_side=side)
    if input_format == "thd":
        batch = pack(input_ids, attention_mask, labels)
    else:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    batch = _cuda(batch)
    outputs = {}
    for name, model in (("torch", torch_model), ("te", te_model)):
        out = model(**batch)
        out.loss.backward()
        outputs[name] = out
    real = batch["attention_mask"].bool() if input_format != "thd" else slice(None)
    assert _relative_error(outputs["te"].logits[real], outputs["torch"].logits[real]) < 2e-2
    assert abs(outputs["te"].loss.item() - outputs["torch"].loss.item()) < 2e-2 * outputs["torch"].loss.item()
    torch_params, te_params = dict(torch_model.named_parameters()), dict(te_model.named_parameters())
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attention.layernorm_qkv.weight",
        "model.layers.0.self_attention.layernorm_qkv.layer_norm_weight",
        f"model.layers.{NUM_LAYERS - 1}.layernorm_mlp.fc1_weight",
        "model.layers.2.self_attention.proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert _relative_error(te_params[name].grad, torch_params[name].grad) < 5e-2, name


def _fp8_recipes():
    from transformer_engine.common import recipe

    return {
        "DelayedScaling": recipe.DelayedScaling(),
        "Float8CurrentScaling": recipe.Float8CurrentScaling(),
        "Float8BlockScaling": recipe.Float8BlockScaling(),
    }


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_fp8_recipes_train_close_to_bf16(recipe_name, input_format):
    _, bf16_model = _torch_and_te_models()
    fp8_config = NVLlamaConfig(**{**bf16_model.config.to_dict(), "layer_precision": ["fp8"] * NUM_LAYERS})
    fp8_model = NVLlamaForCausalLM(fp8_config, fp8_recipe=_fp8_recipes()[recipe_name])
    fp8_model.load_state_dict(bf16_model.state_dict())
    fp8_model.to("cuda", torch.bfloat16)
    input_ids, attention_mask, labels = make_batch([200, 131, 77, 250])  # 658 tokens: not a multiple of 16
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    batch = _cuda(batch if input_format == "bshd" else pack(input_ids, attention_mask, labels))
    with torch.no_grad():
        bf16_loss = bf16_model(**batch).loss
    for _ in range(2):  # the second step exercises the updated scaling factors
        fp8_out = fp8_model(**batch)
        fp8_out.loss.backward()
    assert torch.isfinite(fp8_out.loss)
    assert abs(fp8_out.loss.item() - bf16_loss.item()) < 0.05 * bf16_loss.item()
    grads = [p.grad for p in fp8_model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert fp8_model.model.layers[0].self_attention.layernorm_qkv.fp8


@pytest.mark.requires_fp8
def test_layer_precision_is_honoured_per_layer():
    from transformer_engine.common import recipe

    _, bf16_model = _torch_and_te_models()
    precision = ["fp8", None, None, "fp8"]
    model = NVLlamaForCausalLM(
        NVLlamaConfig(**{**bf16_model.config.to_dict(), "layer_precision": precision}),
        fp8_recipe=recipe.Float8CurrentScaling(),
    ).to("cuda", torch.bfloat16)
    input_ids, attention_mask, labels = make_batch([64, 32])
    model(input_ids.cuda(), attention_mask=attention_mask.cuda(), labels=labels.cuda()).loss.backward()
    for layer, wanted in zip(model.model.layers, precision):
        assert layer.self_attention.layernorm_qkv.fp8 == (wanted == "fp8")
        assert layer.layernorm_mlp.fp8 == (wanted == "fp8")


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
    assert _relative_error(cached[:, :prefill][real[:, :prefill]], full[:, :prefill][real[:, :prefill]]) < tolerance
    for t in range(prefill, input_ids.shape[1]):
        assert _relative_error(cached[:, t], full[:, t]) < tolerance, f"decoding step at position {t}"


def test_export_loads_on_gpu_with_te(tmp_path):
    torch.manual_seed(0)
    hf_model = randomize_(LlamaForCausalLM(hf_llama_config(LLAMA3_ROPE, **TINY_GQA_SHAPE))).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    out = export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).to("cuda", torch.bfloat16).eval()
    assert model.backend == "te"
    input_ids, attention_mask, _ = make_batch([40, 25], padding_side="left")
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    with torch.no_grad():
        actual = model(input_ids, attention_mask=attention_mask).logits
        expected = hf_model.cuda().to(torch.bfloat16)(input_ids, attention_mask=attention_mask).logits
        generated = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=5, pad_token_id=PAD, eos_token_id=None
        )
    real = attention_mask.bool()
    assert _relative_error(actual[real], expected[real]) < 2e-2
    assert generated.shape == (2, 45)


def test_meta_init_with_te_on_one_gpu():
    config = NVLlamaConfig.from_pretrained(MODEL_CONFIGS / "llama3-tiny-nucleotide", backend="te")
    with torch.device("meta"):
        model = NVLlamaForCausalLM(config)
    model.init_empty_weights("cuda")
    std = config.initializer_range
    for name, param in model.named_parameters():
        assert param.device.type == "cuda", name
        if name.endswith(("layer_norm_weight", "norm.weight")):
            assert torch.all(param == 1), name
        else:
            assert abs(param.float().std().item() - std) < 0.1 * std, name
    input_ids, attention_mask, labels = make_batch([50, 20])
    loss = model(input_ids.cuda(), attention_mask=attention_mask.cuda(), labels=labels.cuda()).loss
    assert torch.isfinite(loss)
