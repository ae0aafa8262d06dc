"""ESM-2 with TE's layers (what FP8 runs build; ``fused_residual_norm`` off) calls cuDNN's attention directly from the
second call with a signature on (``te_attention.call_cudnn_directly``), without ``DotProductAttention``'s Python per
call: loss and every gradient equal those of the same model with TE's own attention, bit for bit, in bf16 and under
each FP8 recipe (attention itself stays in 16 bits there).

cuDNN's attention backward may add dQ in any order unless TE asks for its deterministic algorithm, read when TE's
attention is built: both models are built with ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``."""

import pytest
import torch
from esm_testing import hf_esm2_config, model_inputs, randomize_
from transformers import EsmForMaskedLM

from esm2_te import modeling_esm_te, te_attention
from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.modeling_esm_te import NVEsmForMaskedLM


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]

# Widths that every FP8 recipe takes (Float8BlockScaling's 128-wide blocks); heads of 64 as ESM-2 650M.
SHAPE = {"num_hidden_layers": 2, "hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}


@pytest.fixture
def direct_calls(monkeypatch):
    """How many times the direct cuDNN path ran."""
    calls = []
    apply = te_attention._CuDNNAttention.apply
    monkeypatch.setattr(te_attention._CuDNNAttention, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls


def _model(state: dict, config, recipe_name: str | None) -> NVEsmForMaskedLM:
    recipe = None
    if recipe_name is not None:
        from transformer_engine.common import recipe as te_recipe

        recipe = getattr(te_recipe, recipe_name)()
        config = type(config)(**{**config.to_dict(), "layer_precision": ["fp8"] * config.num_hidden_layers})
    model = NVEsmForMaskedLM(config, fp8_recipe=recipe).cuda().train()
    model.load_state_dict(state)
    return model


def _two_steps(model: NVEsmForMaskedLM, batch: dict) -> list[list[torch.Tensor]]:
    """Loss and every parameter's gradient of two forward + backward passes (no update in between)."""
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        steps.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    return steps


@pytest.mark.parametrize(
    "recipe_name",
    [None, pytest.param("DelayedScaling", marks=pytest.mark.requires_fp8),
     pytest.param("Float8CurrentScaling", marks=pytest.mark.requires_fp8),
     pytest.param("Float8BlockScaling", marks=pytest.mark.requires_fp8)],
    ids=["bf16", "delayed", "current", "block"],
)  # fmt: skip
def test_te_layers_call_cudnn_directly_with_te_attention_bits(recipe_name, direct_calls, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch.manual_seed(0)
    converted = convert_esm_hf_to_te(randomize_(EsmForMaskedLM(hf_esm2_config(**SHAPE))), backend="te")
    state, config = converted.state_dict(), converted.config
    assert not config.fused_residual_norm
    direct = _model(state, config, recipe_name)
    with monkeypatch.context() as patch:  # the same model with TE's own attention
        patch.setattr(modeling_esm_te, "call_cudnn_directly", lambda layers: 0)
        plain = _model(state, config, recipe_name)
    attention = [layer.self_attention.core_attention for layer in direct.esm.encoder.layers]
    assert all(isinstance(module, te_attention.PackedCuDNNAttention) for module in attention)
    assert not any(isinstance(layer.self_attention.core_attention, te_attention.PackedCuDNNAttention)
                   for layer in plain.esm.encoder.layers)  # fmt: skip
    assert sorted(direct.state_dict()) == sorted(plain.state_dict())  # checkpoints are unchanged
    batch = model_inputs("thd")

    expected = _two_steps(plain, batch)
    assert direct_calls == []
    actual = _two_steps(direct, batch)
    assert len(direct_calls) == SHAPE["num_hidden_layers"]  # the second step's: the first call is TE's
    for step_actual, step_expected in zip(actual, expected):
        assert len(step_actual) == len(step_expected)
        for a, e in zip(step_actual, step_expected):
            assert torch.equal(a, e)
