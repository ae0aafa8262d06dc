"""ESM-2's fused layers in FP8 (``fused_residual_norm=True`` with ``layer_precision`` "fp8"): the norms are the fused
Triton kernels, the GEMMs TE's FP8 ones (``te.Linear`` for QKV and proj, ``fp8_mlp.QuantizedMLP`` for the MLP). Their
gradients are as close to the bf16 model's as TE's layers' in FP8 are, they train like TE's FP8 layers, they really
compute in FP8, and their FP8 scaling state loads into TE's layers and back."""

import pytest
import torch
from esm_testing import hf_esm2_config, model_inputs, randomize_
from transformers import EsmForMaskedLM

from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.fused_residual_layer import FusedResidualTransformerLayer
from esm2_te.modeling_esm_te import NVEsmForMaskedLM


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te, pytest.mark.requires_fp8]

# Widths that every FP8 recipe takes (Float8BlockScaling's 128-wide blocks); heads of 64 as ESM-2 650M.
SHAPE = {"num_hidden_layers": 3, "hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}
RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    model = convert_esm_hf_to_te(randomize_(EsmForMaskedLM(hf_esm2_config(**SHAPE))), backend="te")
    return model.state_dict(), model.config


def _model(converted, *, fused: bool, recipe_name: str | None = None, recompute: int = 0) -> NVEsmForMaskedLM:
    state, config = converted
    recipe = None
    overrides = {"fused_residual_norm": fused, "recompute_layers": recompute}
    if recipe_name is not None:
        from transformer_engine.common import recipe as te_recipe

        recipe = getattr(te_recipe, recipe_name)()
        overrides["layer_precision"] = ["fp8"] * config.num_hidden_layers
    config = type(config)(**{**config.to_dict(), **overrides})
    model = NVEsmForMaskedLM(config, fp8_recipe=recipe).cuda().train()
    model.load_state_dict(state)  # (the bf16 model's _extra_state entries are empty)
    layers = model.esm.encoder.layers
    assert all(isinstance(layer, FusedResidualTransformerLayer) == fused for layer in layers)
    return model


def _gradients(model: NVEsmForMaskedLM, batch: dict, passes: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of ``passes`` forward + backward passes without an update (the first passes
    let DelayedScaling's amax history see the tensors, so that its scales fit them)."""
    for _ in range(passes):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
    return loss.item(), {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


def _projections(model: NVEsmForMaskedLM):
    for layer in model.esm.encoder.layers:
        yield from (layer.self_attention.layernorm_qkv, layer.self_attention.proj, layer.layernorm_mlp)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_fp8_fused_layers_gradients_are_as_close_to_bf16_as_te_layers(converted, recipe_name):
    """Every parameter's gradient, in FP8 with the fused layers and with TE's, against the same model's in bf16 (TE's
    layers): the fused layers' error may not exceed 1.5 times TE's plus 1% (the two round different bf16 norm outputs
    into FP8, so equality is not expected)."""
    batch = model_inputs("thd")
    reference_loss, reference = _gradients(_model(converted, fused=False), batch, passes=1)
    results = {}
    for fused in (True, False):
        model = _model(converted, fused=fused, recipe_name=recipe_name)
        results[fused] = _gradients(model, batch, passes=3)
        assert all(module.fp8 for module in _projections(model))  # TE's FP8 path ran in every projection
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


@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8BlockScaling"])
def test_fp8_fused_layers_train_like_te_fp8_layers(converted, recipe_name):
    batch = model_inputs("thd")
    losses = {}
    for fused in (True, False):
        model = _model(converted, fused=fused, recipe_name=recipe_name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[fused] = []
        for _ in range(8):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[fused].append(loss.item())
    print(recipe_name, "losses (fused, TE):", losses[True], losses[False])
    assert losses[True][-1] < losses[True][0] - 0.5  # learns the one batch
    assert losses[True] == pytest.approx(losses[False], rel=3e-2, abs=2e-2)


@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling"])
def test_fp8_fused_layers_recompute_what_they_keep(converted, monkeypatch, recipe_name):
    """Recomputed in backward, the fused FP8 layers give the gradients they give keeping their activations, over
    three passes (delayed scaling's later passes use the scales the earlier ones set). Under recompute the norms hand
    TE a bf16 output to cast (``_norm_fp8_output``: TE swaps in the recompute's scales after the norm has run), so the
    run that keeps its activations here does too (the rounding that changes is
    ``test_delayed_scaling_fusions_run_and_change_only_rounding``'s subject)."""
    from esm2_te import fused_residual_layer

    monkeypatch.setattr(fused_residual_layer, "_norm_fp8_output", lambda quantizer: None)
    batch = model_inputs("thd")
    kept = _gradients(_model(converted, fused=True, recipe_name=recipe_name), batch, passes=3)
    recomputed = _gradients(
        _model(converted, fused=True, recipe_name=recipe_name, recompute=SHAPE["num_hidden_layers"]),
        batch,
        passes=3,
    )
    assert recomputed[0] == pytest.approx(kept[0], rel=1e-5)
    for name, grad in kept[1].items():
        error = ((recomputed[1][name] - grad).norm() / grad.norm().clamp(min=1e-12)).item()
        assert error < 1e-3, (name, error)


def test_fp8_scaling_state_loads_into_te_layers_and_back(converted, monkeypatch):
    """After DelayedScaling steps the fused layers' ``_extra_state`` holds their amax histories and scales; TE's
    layers load it (the same keys, the same FP8 state per GEMM), and a fused model loads TE's. (TE 2.20 unpickles
    ``_extra_state`` only when told to; this project's checkpoints leave it out.)"""
    from transformer_engine.pytorch._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV

    monkeypatch.setenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "1")
    batch = model_inputs("thd")
    fused = _model(converted, fused=True, recipe_name="DelayedScaling")
    _gradients(fused, batch, passes=3)
    te_layers = _model(converted, fused=False, recipe_name="DelayedScaling")
    _gradients(te_layers, batch, passes=1)  # (its FP8 state exists, and differs from the fused model's)
    state = fused.state_dict()
    te_layers.load_state_dict(state, strict=True)
    for ours, theirs in zip(_projections(fused), _projections(te_layers), strict=True):
        for direction in ("scaling_fwd", "scaling_bwd"):
            assert torch.equal(ours.fp8_meta[direction].scale, theirs.fp8_meta[direction].scale), direction
            assert torch.equal(ours.fp8_meta[direction].amax_history, theirs.fp8_meta[direction].amax_history)
        assert ours.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0  # real state, not zeros
    again = _model(converted, fused=True, recipe_name="DelayedScaling")
    again.load_state_dict(te_layers.state_dict(), strict=True)
    for ours, theirs in zip(_projections(again), _projections(te_layers), strict=True):
        assert torch.equal(ours.fp8_meta["scaling_fwd"].scale, theirs.fp8_meta["scaling_fwd"].scale)


def test_delayed_scaling_fusions_run_and_change_only_rounding(converted, monkeypatch):
    """Under DelayedScaling each norm writes its GEMM's FP8 input itself (two per layer and pass) and fc1's GEMM
    applies GELU and writes fc2's FP8 input (one per layer and pass). Against the path of the other recipes (bf16 norm
    output and GELU output, each cast by TE), forced here, that changes only rounding (E4M3 from float32 once, not
    through bf16): the same loss within 0.5% and every gradient within 5%, a fraction of FP8's own error against bf16
    (test above). Float8CurrentScaling keeps the bf16 outputs and TE's casts."""
    from esm2_te import fp8_mlp, fused_residual_layer

    batch = model_inputs("thd")
    real_norm_output, real_gemm = fused_residual_layer._norm_fp8_output, fp8_mlp.general_gemm
    norms_in_fp8, gelu_epilogues = [], []

    def norm_output_spy(quantizer):
        output = real_norm_output(quantizer)
        norms_in_fp8.append(output is not None)
        return output

    def gemm_spy(*args, **kwargs):
        if kwargs.get("gelu") and kwargs.get("quantization_params") is not None:
            gelu_epilogues.append(True)
        return real_gemm(*args, **kwargs)

    monkeypatch.setattr(fused_residual_layer, "_norm_fp8_output", norm_output_spy)
    monkeypatch.setattr(fp8_mlp, "general_gemm", gemm_spy)
    layers = SHAPE["num_hidden_layers"]
    fused_loss, fused = _gradients(_model(converted, fused=True, recipe_name="DelayedScaling"), batch, passes=3)
    assert norms_in_fp8 == [True] * (3 * 2 * layers)
    assert len(gelu_epilogues) == 3 * layers
    norms_in_fp8.clear()
    gelu_epilogues.clear()
    _gradients(_model(converted, fused=True, recipe_name="Float8CurrentScaling"), batch, passes=1)
    assert norms_in_fp8 == [False] * (2 * layers) and not gelu_epilogues

    monkeypatch.setattr(fused_residual_layer, "_norm_fp8_output", lambda quantizer: None)
    monkeypatch.setattr(fp8_mlp, "GELU_IN_FC1_EPILOGUE", False)
    cast_loss, cast = _gradients(_model(converted, fused=True, recipe_name="DelayedScaling"), batch, passes=3)
    assert not gelu_epilogues
    assert fused_loss == pytest.approx(cast_loss, rel=5e-3)
    differences = {name: ((fused[name] - grad).norm() / grad.norm()).item() for name, grad in cast.items()}
    print("DelayedScaling fusions vs bf16 outputs cast by TE, gradient difference:", differences)
    assert max(differences.values()) < 5e-2, differences
