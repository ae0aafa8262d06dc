"""fp8_calibration with TransformerEngine on the GPU: the first DelayedScaling step's gradients, against bf16's.

A 4-layer Llama (hidden 512) with the fused layers in FP8 (DelayedScaling, E5M2 gradients, as the L1 configs' advice),
the loss averaged over 8,192 tokens as a training step's is. The reference is the same weights' gradients in bf16.
Without the calibration passes the first FP8 step casts its gradients with scales of 1, and the lowest layer's
gradients are lost (checked below, so that the test shows the problem on this shape); after the passes every layer's
gradients point where bf16's do.
"""

import pytest
import torch
from configuration_llama_te import NVLlamaConfig
from fp8_calibration import calibrate_delayed_scaling, count_calibrated_gradient_scales
from modeling_llama_te import NVLlamaForCausalLM


LAYERS = 4


def build(fp8_recipe, weights=None) -> NVLlamaForCausalLM:
    config = NVLlamaConfig(
        vocab_size=256,
        padded_vocab_size=256,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        backend="te",
        fused_residual_norm=True,
        layer_precision=["fp8"] * LAYERS if fp8_recipe is not None else None,
    )
    torch.manual_seed(0)
    model = NVLlamaForCausalLM(config, fp8_recipe=fp8_recipe).to("cuda", torch.bfloat16)
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    return model


def first_batch() -> dict:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 256, (4, 2048), generator=generator).cuda()
    return {"input_ids": tokens, "labels": tokens, "use_cache": False}


def layer_gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {
        name: param.grad.float().flatten().clone()
        for name, param in model.named_parameters()
        if name.startswith("model.layers.") and name.endswith("weight") and param.grad is not None
    }


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-30))


@pytest.mark.requires_fp8
def test_after_the_passes_the_first_step_has_bf16s_gradients_in_every_layer():
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    batch = first_batch()
    reference = build(None)
    weights = {k: v for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}
    expected = layer_gradients(reference, batch)
    weight_names = sorted(expected)
    assert len(weight_names) >= 4 * LAYERS, weight_names

    uncalibrated = layer_gradients(build(recipe, weights), batch)
    lowest = [name for name in weight_names if name.startswith("model.layers.0.")]
    lost = {name: cosine(uncalibrated.get(name, torch.zeros_like(expected[name])), expected[name]) for name in lowest}
    assert min(lost.values()) < 0.5, lost  # the problem the passes fix, on this shape

    model = build(recipe, weights)
    passes = calibrate_delayed_scaling(
        model, lambda: model(**batch).loss.backward(), zero_grad=lambda: model.zero_grad(set_to_none=True)
    )
    assert 2 <= passes <= 5, passes
    # One quantized gradient per GEMM (QKV, proj, fc1, fc2) per FP8 layer, every one of them with a scale now.
    assert count_calibrated_gradient_scales(model) == 4 * LAYERS
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if isinstance(meta, dict) and "scaling_bwd" in meta:
            for key in ("scaling_fwd", "scaling_bwd"):
                assert torch.isfinite(meta[key].scale).all() and torch.isfinite(meta[key].amax_history).all()
    calibrated = layer_gradients(model, batch)
    agreement = {name: cosine(calibrated[name], expected[name]) for name in weight_names}
    assert min(agreement.values()) > 0.95, agreement
