"""Llama's fused QKV layout, and conversion errors that name the weights at fault. The round trip and the export are
in the model contract (test_model_contract.py)."""

import pytest
import torch

from llama3_te.convert import convert_llama_hf_to_te, convert_llama_te_to_hf
from llama3_te.weight_conversion import interleave_qkv, load_state_dict_exactly


def test_fused_qkv_follows_te_group_layout():
    """Per key/value group: that group's query heads, then its key head, then its value head."""
    heads, groups, head_dim, hidden = 4, 2, 3, 5
    q = torch.arange(heads * head_dim).repeat_interleave(hidden).view(heads * head_dim, hidden).float()
    k = 100 + torch.arange(groups * head_dim).repeat_interleave(hidden).view(groups * head_dim, hidden).float()
    v = 200 + torch.arange(groups * head_dim).repeat_interleave(hidden).view(groups * head_dim, hidden).float()
    fused = interleave_qkv(q, k, v, groups)[:, 0].tolist()
    expected = [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201, 202, 6, 7, 8, 9, 10, 11, 103, 104, 105, 203, 204, 205]
    assert fused == expected


def test_conversion_names_mismatched_weights(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    nv_model.model.layers[0].layernorm_mlp.fc2_weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"shape mismatch.*layers\.0\.mlp\.down_proj\.weight: checkpoint \(3, 3\)"):
        convert_llama_te_to_hf(nv_model)


def test_loading_names_missing_and_unexpected_keys(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    state = {k: v for k, v in nv_model.state_dict().items() if k != "model.norm.weight"}
    state["lm_head.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['model.norm.weight'\].*unexpected keys \(1\)"):
        load_state_dict_exactly(nv_model, state, "a test checkpoint")
