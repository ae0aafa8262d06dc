"""AMPLIFY's fused layers in FP8 (``fused_residual_norm=True`` with ``layer_precision`` "fp8"): the RMSNorm kernels
stay, the GEMMs are TE's FP8 ones (``te.Linear`` for QKV and proj, ``fp8_mlp.QuantizedMLP`` with SwiGLU for the MLP). Their
gradients are as close to the bf16 model's as TE's layers' in FP8 are, and they train like TE's FP8 layers."""

import pytest
import torch
from amplify_testing import make_batch, reference_model, reference_to_nv
from model_contract import pack

from amplify_te.fused_residual_layer import FusedResidualTransformerLayer
from amplify_te.modeling_amplify_te import NVAmplifyForMaskedLM


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te, pytest.mark.requires_fp8]

# Widths every FP8 recipe takes (Float8BlockScaling's 128-wide blocks: the SwiGLU width is 3072 * 2/3 = 2048); heads
# of 64 as AMPLIFY's. The batch's 688 tokens are a multiple of 16, as FP8 GEMMs need.
SHAPE = {"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072}
LENGTHS = [200, 130, 77, 250, 31]


@pytest.fixture(scope="module")
def converted():
    model = reference_to_nv(reference_model(SHAPE), backend="te", fused_qkv_rope=True)
    return model.state_dict(), model.config


def _model(converted, *, fused: bool, recipe_name: str | None = None) -> NVAmplifyForMaskedLM:
    state, config = converted
    recipe = None
    overrides = {"fused_residual_norm": fused}
    if recipe_name is not None:
        from transformer_engine.common import recipe as te_recipe

        recipe = getattr(te_recipe, recipe_name)()
        overrides["layer_precision"] = ["fp8"] * config.num_hidden_layers
    config = type(config)(**{**config.to_dict(), **overrides})
    model = NVAmplifyForMaskedLM(config, fp8_recipe=recipe).cuda().train()
    model.load_state_dict(state)
    assert all(isinstance(layer, FusedResidualTransformerLayer) == fused for layer in model.amplify.layers)
    return model


def _batch() -> dict:
    batch = pack(make_batch(LENGTHS))
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _gradients(model, batch: dict, passes: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of ``passes`` forward + backward passes (DelayedScaling's amax history sees the
    tensors in the first ones)."""
    for _ in range(passes):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
    return loss.item(), {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_fused_layers_gradients_are_as_close_to_bf16_as_te_layers(converted, recipe_name):
    """Every gradient, in FP8 with the fused layers and with TE's, against the bf16 model's (TE's layers): the fused
    layers' error may not exceed 1.5 times TE's plus 1%."""
    batch = _batch()
    reference_loss, reference = _gradients(_model(converted, fused=False), batch, passes=1)
    results = {}
    for fused in (True, False):
        model = _model(converted, fused=fused, recipe_name=recipe_name)
        results[fused] = _gradients(model, batch, passes=3)
        layers = model.amplify.layers
        assert all(m.fp8 for layer in layers for m in (layer.self_attention.proj, layer.layernorm_mlp))
    (fused_loss, fused_grads), (te_loss, te_grads) = results[True], results[False]
    assert fused_loss == pytest.approx(reference_loss, rel=2e-2)
    assert te_loss == pytest.approx(reference_loss, rel=2e-2)
    assert sorted(fused_grads) == sorted(te_grads) == sorted(reference)

    def error(grads, name):
        return ((grads[name] - reference[name]).norm() / reference[name].norm()).item()

    report = {name: (round(error(fused_grads, name), 4), round(error(te_grads, name), 4)) for name in reference}
    print(recipe_name, "gradient error against bf16 (fused layers, TE's layers):", report)
    for name, (fused_error, te_error) in report.items():
        assert fused_error <= 1.5 * te_error + 1e-2, (name, fused_error, te_error)
    # FP8 really ran: the MLP's weight gradients are further from bf16 than bf16 rounding puts them.
    assert max(fused_error for name, (fused_error, _) in report.items() if "fc1_weight" in name) > 1e-3


def test_fp8_fused_layers_train_like_te_fp8_layers(converted):
    batch = _batch()
    losses = {}
    for fused in (True, False):
        model = _model(converted, fused=fused, recipe_name="DelayedScaling")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[fused] = []
        for _ in range(8):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[fused].append(loss.item())
    print("losses (fused, TE):", losses[True], losses[False])
    assert losses[True][-1] < losses[True][0]  # learns
    assert losses[True] == pytest.approx(losses[False], rel=3e-2, abs=2e-2)
