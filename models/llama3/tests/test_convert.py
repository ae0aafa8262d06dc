"""Llama's fused QKV layout, conversion errors that name the weights at fault, and what the conversion keeps besides
the weights. The round trip of the weights and the export are in the model contract (test_model_contract.py)."""

import pytest
import torch
from transformers import GenerationConfig

from llama3_te.convert import convert_llama_hf_to_te, convert_llama_te_to_hf
from llama3_te.export import save_nv_checkpoint
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


def test_generation_settings_and_the_stock_config_survive_conversion_and_export(hf_tiny, tmp_path):
    """A checkpoint's generation_config (two <eos> ids, as Llama-3-Instruct's, sampling defaults) is not one derived
    from the model config: it goes through HF -> NV -> HF and into the export; and the stock config comes back
    without the NV-only fields (recompute, fused-kernel and init switches)."""
    settings = {"eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 17}
    for key, value in settings.items():
        setattr(hf_tiny.generation_config, key, value)
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    back = convert_llama_te_to_hf(nv_model)
    save_nv_checkpoint(nv_model, tmp_path / "export")
    exported = GenerationConfig.from_pretrained(tmp_path / "export")
    for generation_config in (nv_model.generation_config, back.generation_config, exported):
        assert {key: getattr(generation_config, key) for key in settings} == settings
    assert back.config.to_diff_dict() == hf_tiny.config.to_diff_dict()
