"""Conversion errors that name the ESM-2 weights at fault, checkpoints it refuses, and the stock config it gives back.
The round trip of the weights and the export are in the model contract (test_model_contract.py)."""

import pytest
import torch
from esm_testing import TINY_SHAPE, hf_esm2_config
from transformers import EsmForMaskedLM

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


def test_an_untied_lm_head_is_refused_not_dropped(hf_tiny):
    """NVEsm decodes with the word embeddings; a checkpoint with its own decoder weights would lose them silently."""
    untied = EsmForMaskedLM(hf_esm2_config(**TINY_SHAPE, tie_word_embeddings=False))
    assert not torch.equal(untied.lm_head.decoder.weight, untied.esm.embeddings.word_embeddings.weight)
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        convert_esm_hf_to_te(untied, backend="torch")


def test_the_stock_config_comes_back_without_nv_only_fields(hf_tiny):
    """HF -> NV -> HF: not one field more or less (no recompute or fused-kernel switches in the stock config)."""
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch", recompute_layers=1, fused_qkv_rope=False)
    assert convert_esm_te_to_hf(nv_model).config.to_diff_dict() == hf_tiny.config.to_diff_dict()
