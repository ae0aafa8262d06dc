"""Config settings AMPLIFY's implementation cannot honour are named; the shipped shapes are the published ones; the
init is the published uniform one. Meta-device init, backend selection, quantized layers on the torch backend, bad
THD input and the settings every model checks are in the model contract (test_model_contract.py)."""

import json

import pytest
import torch
from amplify_reference import AmplifyReference, AmplifyReferenceConfig
from amplify_testing import MODEL_CONFIGS, TINY_SHAPE

from amplify_te.configuration_amplify_te import NVAmplifyConfig, swiglu_hidden_size
from amplify_te.modeling_amplify_te import NVAmplifyForMaskedLM


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 65}, "divisible by num_attention_heads"),
        ({"hidden_size": 60, "num_attention_heads": 4}, r"head dimension \(15\) must be even"),
        ({"rms_norm": False}, "rms_norm=False"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"att_bias": True}, "att_bias and ffn_bias must be False"),
        ({"ffn_bias": True}, "att_bias and ffn_bias must be False"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        NVAmplifyConfig(**{**TINY_SHAPE, "backend": "torch", **overrides})


def test_every_problem_is_named_at_once():
    with pytest.raises(ValueError, match="rms_norm=False.*SwiGLU"):
        NVAmplifyConfig(**TINY_SHAPE, backend="torch", rms_norm=False, hidden_act="relu")


# name: published (layers, hidden, heads, intermediate, SwiGLU width)
PUBLISHED_SHAPES = {"AMPLIFY_120M": (24, 640, 10, 2560, 1712), "AMPLIFY_350M": (32, 960, 15, 3840, 2560)}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SHAPES))
def test_shipped_configs_are_the_published_shapes_with_the_reference_parameter_count(name):
    layers, hidden, heads, intermediate, ffn = PUBLISHED_SHAPES[name]
    values = json.loads((MODEL_CONFIGS / name / "config.json").read_text())
    config = NVAmplifyConfig(**{**values, "backend": "torch"})
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.intermediate_size)
    assert shape == (layers, hidden, heads, intermediate)
    assert swiglu_hidden_size(config.intermediate_size) == ffn
    assert (config.norm_eps, config.max_length, config.vocab_size) == (1e-5, 2048, 27)
    assert config.layer_norm_before_last_layer and not config.layer_norm_after_embedding
    with torch.device("meta"):  # full size, no memory
        nv_model = NVAmplifyForMaskedLM(config)
        reference = AmplifyReference(
            AmplifyReferenceConfig(
                **{
                    k: values[k]
                    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
                }
            )
        )
    vocab_padding = (config.padded_vocab_size - config.vocab_size) * (2 * hidden + 1)  # embedding, decoder, bias
    nv_count = sum(p.numel() for p in nv_model.parameters()) - vocab_padding
    assert nv_count == sum(p.numel() for p in reference.parameters())


def test_init_is_uniform_within_the_published_ranges():
    config = NVAmplifyConfig(
        **{**TINY_SHAPE, "hidden_size": 256, "intermediate_size": 512}, backend="torch", decoder_init_range=0.05
    )
    torch.manual_seed(0)
    model = NVAmplifyForMaskedLM(config)
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        bound = 0.02 if name == "amplify.embeddings.weight" else 0.05
        # A uniform draw fills its interval: the extremes come within 1% of the bound and never pass it.
        assert 0.99 * bound < param.abs().max().item() <= bound, name
        assert abs(param.std().item() / (bound / 3**0.5) - 1) < 0.05, name
    assert config.initializer_range == pytest.approx(0.05 / 3**0.5)
