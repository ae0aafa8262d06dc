"""Llama's init switches, config settings Llama cannot honour, and errors of the KV cache, shift_labels and context
parallelism. Meta-device init, backend selection, quantized layers on the torch backend, bad THD input and the
settings every model checks are in the model contract (test_model_contract.py)."""

import pytest
import torch
from init_statistics import assert_initialised_as_configured
from llama_testing import TINY_GQA_SHAPE, make_batch
from model_contract import pack

from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM


def _config(**overrides) -> NVLlamaConfig:
    shape = {**TINY_GQA_SHAPE, "hidden_size": 256, "intermediate_size": 512}
    return NVLlamaConfig(**{**shape, "vocab_size": 256, "backend": "torch", **overrides})


@pytest.mark.parametrize(
    "switches",
    [
        {"embedding_init_std": 1.0},
        {"scale_output_projection_init": True},
        {"embedding_init_std": 1.0, "scale_output_projection_init": True},
    ],
    ids=["spike_no_more_embedding", "scaled_output_projections", "both"],
)
@pytest.mark.parametrize("on_meta_device", [False, True], ids=["direct", "meta"])
def test_init_switches_set_the_documented_std(switches, on_meta_device):
    # 8 layers: scaled output projections start at 0.02 / sqrt(16) = 0.005, far from the unscaled 0.02.
    config = _config(num_hidden_layers=8, **switches)
    torch.manual_seed(0)
    with torch.device("meta" if on_meta_device else "cpu"):
        model = NVLlamaForCausalLM(config)
    if on_meta_device:
        model.init_empty_weights("cpu")
    assert_initialised_as_configured(dict(model.named_parameters()), config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_key_value_heads": 3}, "divisible by num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act='silu'"),
        ({"attention_bias": True}, "attention_bias and mlp_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type must be one of"),
        ({"embedding_init_std": 0.0}, "embedding_init_std must be positive"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_legacy_rope_scaling_argument_is_read():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = _config(rope_scaling={**scaling, "original_max_position_embeddings": 8192}, rope_theta=500000.0)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    reloaded = NVLlamaConfig.from_dict(config.to_dict())
    assert reloaded.rope_parameters == config.rope_parameters


@pytest.fixture
def tiny_model(hf_tiny):
    return convert_llama_hf_to_te(hf_tiny, backend="torch").eval()


def _batch(lengths: list[int]) -> dict:
    return dict(zip(("input_ids", "attention_mask", "labels"), make_batch(lengths)))


def test_cache_errors_are_named(tiny_model):
    input_ids, attention_mask, labels = make_batch([10, 6])
    with pytest.raises(ValueError, match="labels cannot be combined with a KV cache"):
        tiny_model(input_ids, attention_mask=attention_mask, labels=labels, use_cache=True)
    with pytest.raises(ValueError, match="attention_mask must cover"):
        tiny_model(input_ids, attention_mask=attention_mask[:, :4], use_cache=True)


def test_labels_and_shift_labels_are_exclusive_and_cp_needs_a_group(tiny_model):
    batch = pack(_batch([10, 6]))
    with pytest.raises(ValueError, match="not both"):
        tiny_model(**batch, shift_labels=batch["labels"])
    with pytest.raises(ValueError, match="call set_context_parallel_group"):
        tiny_model(**batch, cu_seq_lens_q_padded=batch["cu_seq_lens_q"])
