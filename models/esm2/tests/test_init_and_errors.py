"""Config settings ESM-2 cannot honour are named. Meta-device init, backend selection, quantized layers on the
torch backend, bad THD input and the settings every model checks are in the model contract
(test_model_contract.py)."""

import pytest
from esm_testing import TINY_SHAPE

from esm2_te.modeling_esm_te import NVEsmConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 65}, "divisible by num_attention_heads"),
        ({"position_embedding_type": "absolute"}, "rotary"),
        (
            {"fused_residual_norm": True, "layer_precision": ["fp4", None]},
            "fused_residual_norm layers compute in bf16/fp32 or FP8",
        ),
        ({"fused_residual_norm": True, "hidden_dropout_prob": 0.1}, "fused_residual_norm layers have no dropout"),
        ({"fused_residual_norm": True, "attention_probs_dropout_prob": 0.1}, "fused_residual_norm layers have no"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        NVEsmConfig(**{**TINY_SHAPE, "backend": "torch", **overrides})
