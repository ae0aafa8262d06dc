"""Conversion errors that name the ESM-2 weights at fault. The round trip and the export are in the model contract
(test_model_contract.py)."""

import pytest
import torch

from esm2_te.convert import convert_esm_hf_to_te, convert_esm_te_to_hf
from esm2_te.weight_conversion import load_state_dict_exactly


def test_conversion_names_missing_and_mismatched_weights(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    nv_model.esm.encoder.layers[0].layernorm_mlp.fc1_weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(
        ValueError, match=r"shape mismatch.*layer\.0\.intermediate\.dense\.weight: checkpoint \(3, 3\)"
    ):
        convert_esm_te_to_hf(nv_model)


def test_loading_names_missing_and_unexpected_keys(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    state = {k: v for k, v in nv_model.state_dict().items() if k != "lm_head.dense.bias"}
    state["lm_head.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['lm_head.dense.bias'\].*unexpected keys \(1\)"):
        load_state_dict_exactly(nv_model, state, "a test checkpoint")
