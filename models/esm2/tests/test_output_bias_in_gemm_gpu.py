"""ESM-2 with TE's layers (what FP8 runs build; ``fused_residual_norm`` off) adds the attention-output and fc2 biases in
the GEMMs and the residual with a plain add (``add_output_biases_in_gemms``), in place of TE's compiled
bias-dropout-add. The same sums, rounded at another point: in bf16 training gives the same losses and weights within
bf16 rounding; in FP8 every gradient is as close to the bf16 model's as TE's own path gets it.

The reference model in each test is built with ``NVTE_BIAS_DROPOUT_FUSION=1`` in the environment (TE's compiled
bias-dropout-add, what TE's layer does by default)."""

import pytest
import torch
from esm_testing import hf_esm2_config, model_inputs, randomize_
from transformers import EsmForMaskedLM

from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.modeling_esm_te import NVEsmForMaskedLM


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]

# Widths that every FP8 recipe takes (Float8BlockScaling's 128-wide blocks); heads of 64 as ESM-2 650M.
SHAPE = {"num_hidden_layers": 3, "hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    model = convert_esm_hf_to_te(randomize_(EsmForMaskedLM(hf_esm2_config(**SHAPE))), backend="te")
    assert not model.config.fused_residual_norm
    return model.state_dict(), model.config


def _model(converted, monkeypatch, *, in_gemm: bool, recipe_name: str | None = None) -> NVEsmForMaskedLM:
    state, config = converted
    recipe = None
    if recipe_name is not None:
        from transformer_engine.common import recipe as te_recipe

        recipe = getattr(te_recipe, recipe_name)()
        config = type(config)(**{**config.to_dict(), "layer_precision": ["fp8"] * config.num_hidden_layers})
    with monkeypatch.context() as patch:
        if in_gemm:
            patch.delenv("NVTE_BIAS_DROPOUT_FUSION", raising=False)
        else:
            patch.setenv("NVTE_BIAS_DROPOUT_FUSION", "1")
        model = NVEsmForMaskedLM(config, fp8_recipe=recipe).cuda().train()
    model.load_state_dict(state)
    for layer in model.esm.encoder.layers:  # which path each model runs
        for module in (layer.self_attention.proj, layer.layernorm_mlp):
            assert (module.apply_bias, module.return_bias) == ((True, False) if in_gemm else (False, True))
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


def test_bf16_training_matches_te_bias_dropout_add(converted, monkeypatch):
    batch = model_inputs("thd")
    runs = {}
    for in_gemm in (True, False):
        model = _model(converted, monkeypatch, in_gemm=in_gemm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs[in_gemm] = losses, dict(model.named_parameters())
    (gemm_losses, gemm_params), (te_losses, te_params) = runs[True], runs[False]
    assert gemm_losses == pytest.approx(te_losses, rel=1e-2)
    assert gemm_losses[-1] < gemm_losses[0]  # it learns
    for name, param in gemm_params.items():
        error = (param - te_params[name]).norm() / te_params[name].norm()
        assert error < 2e-2, (name, error.item())


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_gradients_are_as_close_to_bf16_as_te_bias_dropout_add(converted, monkeypatch, recipe_name):
    """Every parameter's gradient, in FP8 by either path, against the same model's in bf16 (TE's path): the error of
    the biases-in-GEMM path may not exceed 1.5 times TE's path's plus 1% (FP8's rounding differs between two paths
    that round their inputs differently, so equality is not expected)."""
    batch = model_inputs("thd")
    reference_loss, reference = _gradients(_model(converted, monkeypatch, in_gemm=False), batch, passes=1)
    results = {}
    for in_gemm in (True, False):
        model = _model(converted, monkeypatch, in_gemm=in_gemm, recipe_name=recipe_name)
        results[in_gemm] = _gradients(model, batch, passes=3)
    (gemm_loss, gemm_grads), (te_loss, te_grads) = results[True], results[False]
    assert gemm_loss == pytest.approx(reference_loss, rel=2e-2)
    assert te_loss == pytest.approx(reference_loss, rel=2e-2)
    assert sorted(gemm_grads) == sorted(te_grads) == sorted(reference)

    def error(grads, name):
        return ((grads[name] - reference[name]).norm() / reference[name].norm()).item()

    report = {name: (round(error(gemm_grads, name), 4), round(error(te_grads, name), 4)) for name in reference}
    print(recipe_name, "gradient error against bf16 (biases in GEMM, TE's path):", report)
    for name, (gemm_error, te_error) in report.items():
        assert gemm_error <= 1.5 * te_error + 1e-2, (name, gemm_error, te_error)
    for name in reference:  # the two biases whose gradient moved to TE's GEMM / cast kernels
        if name.endswith(("proj.bias", "fc2_bias")):
            assert gemm_grads[name].abs().sum() > 0, name
