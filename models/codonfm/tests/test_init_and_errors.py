"""Config settings Encodon's implementation cannot honour are named; the shipped presets are the published shapes with
the parameter counts worked out by hand; the init is MAGNETO's, per parameter, built directly and on the meta device,
for both heads. Meta-device init of the MLM model, backend selection, quantized layers on the torch backend, bad THD
input and the settings every model checks are in the model contract (test_model_contract.py)."""

import json
import math

import pytest
import torch
from codonfm_testing import MODEL_CONFIGS, TINY_SHAPE, hyper_parameters
from encodon_reference import EncodonReference, EncodonReferenceConfig
from init_statistics import assert_initialised_as_configured

from codonfm_te.convert import convert_encodon_checkpoint_to_te
from codonfm_te.modeling_codonfm_te import (
    NVEncodonConfig,
    NVEncodonForMaskedLM,
    NVEncodonForSequenceClassification,
)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 65}, "divisible by num_attention_heads"),
        ({"hidden_size": 60, "num_attention_heads": 4}, r"head dimension \(15\) must be even"),
        ({"hidden_act": "gelu_new"}, "hidden_act must be one of"),
        ({"init_scheme": "normal"}, "init_scheme must be one of"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings must be False"),
        ({"hidden_dropout_prob": 1.5}, r"hidden_dropout_prob must be in \[0, 1\)"),
        ({"classifier_dropout": -0.1}, "classifier_dropout must be in"),
        ({"rotary_theta": 0.0}, "rotary_theta, initializer_range and layer_norm_eps must be positive"),
        ({"pad_token_id": 69}, "pad_token_id must be a token id below vocab_size"),
        ({"num_hidden_layers": 0}, "must be positive"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        NVEncodonConfig(**{**TINY_SHAPE, "backend": "torch", **overrides})


def test_every_problem_is_named_at_once():
    with pytest.raises(ValueError, match="hidden_act.*tie_word_embeddings"):
        NVEncodonConfig(**TINY_SHAPE, backend="torch", hidden_act="tanh", tie_word_embeddings=True)


def test_padded_vocabulary_defaults_to_128():
    assert NVEncodonConfig(**TINY_SHAPE).padded_vocab_size == 128


# ------------------------------------------------------------------------------------------------------- presets

# name: published (layers, hidden, heads, intermediate), CodonFM src/config.py MODEL_ARCHITECTURES
PUBLISHED_SHAPES = {
    "encodon_80m": (6, 1024, 8, 4096),
    "encodon_600m": (12, 2048, 16, 8192),
    "encodon_1b": (18, 2048, 16, 8192),
}


def published_parameter_count(layers: int, hidden: int, intermediate: int, vocab: int = 69) -> int:
    """Counted by hand from the published modules (every linear has a bias, every LayerNorm a weight and a bias)."""
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    per_layer = (
        3 * linear(hidden, hidden)  # query, key, value
        + linear(hidden, hidden)  # post_attn_dense
        + linear(hidden, intermediate)  # intermediate_dense
        + linear(intermediate, hidden)  # output_dense
        + 3 * 2 * hidden  # pre_attn, post_attn, pre_ffn LayerNorms
        + 2 * intermediate  # post_ffn LayerNorm (over the intermediate width)
    )
    embeddings = vocab * hidden + 2 * hidden  # word embeddings, post_ln
    head = linear(hidden, hidden) + 2 * hidden + linear(hidden, vocab)  # cls: dense, LayerNorm, decoder
    return layers * per_layer + embeddings + head


@pytest.mark.parametrize("name", sorted(PUBLISHED_SHAPES))
def test_shipped_configs_are_the_published_shapes(name):
    layers, hidden, heads, intermediate = PUBLISHED_SHAPES[name]
    values = json.loads((MODEL_CONFIGS / name / "config.json").read_text())
    config = NVEncodonConfig(**{**values, "backend": "torch"})
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.intermediate_size)
    assert shape == (layers, hidden, heads, intermediate)
    assert (config.vocab_size, config.padded_vocab_size, config.pad_token_id) == (69, 128, 3)
    assert (config.hidden_act, config.layer_norm_eps, config.rotary_theta) == ("gelu", 1e-12, 1e4)
    assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob, config.initializer_range) == (
        0.1,
        0.1,
        0.02,
    )
    assert values["architectures"] == ["NVEncodonForMaskedLM"] and values["model_type"] == "bert"


@pytest.mark.parametrize(("name", "millions"), [("encodon_80m", 76.8), ("encodon_600m", 609.0), ("encodon_1b", 911.3)])
def test_presets_have_the_published_parameter_count(name, millions):
    """NV model (vocabulary padding left out) = the reference = the count by hand, on the meta device (no memory)."""
    layers, hidden, heads, intermediate = PUBLISHED_SHAPES[name]
    config = NVEncodonConfig.from_pretrained(MODEL_CONFIGS / name, backend="torch")
    with torch.device("meta"):
        nv_model = NVEncodonForMaskedLM(config)
        reference = EncodonReference(
            EncodonReferenceConfig(
                num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=intermediate
            )
        )
    by_hand = published_parameter_count(layers, hidden, intermediate)
    padding = (config.padded_vocab_size - config.vocab_size) * (2 * hidden + 1)  # embedding, decoder rows, bias
    assert sum(p.numel() for p in nv_model.parameters()) - padding == by_hand
    assert sum(p.numel() for p in reference.parameters()) == by_hand
    assert round(by_hand / 1e6, 1) == millions


# --------------------------------------------------------------------------------------------------- MAGNETO init


def init_test_config(**overrides) -> NVEncodonConfig:
    """Wide enough for tight statistics, with a deeper gain than the 2-layer tiny shape (log(2 * 6))."""
    values = {**TINY_SHAPE, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "backend": "torch"}
    return NVEncodonConfig(**{**values, "num_labels": 3, **overrides})


@pytest.mark.parametrize("model_class", [NVEncodonForMaskedLM, NVEncodonForSequenceClassification])
@pytest.mark.parametrize("construction", ["direct", "meta"])
def test_every_parameter_holds_magneto_init(model_class, construction):
    config = init_test_config()
    torch.manual_seed(0)
    if construction == "direct":
        model = model_class(config)
    else:
        with torch.device("meta"):
            model = model_class(config)
        model.init_empty_weights("cpu")
    assert_initialised_as_configured(dict(model.named_parameters()), config)
    # The padding row is zero, the padded vocabulary rows are drawn like the others.
    embedding = model.encodon.embeddings.word_embeddings.weight
    assert torch.count_nonzero(embedding[config.pad_token_id]) == 0
    assert torch.count_nonzero(embedding[config.vocab_size :]) == embedding[config.vocab_size :].numel()


def test_magneto_stds_by_hand():
    """A few stds written out for one config (hidden 256, FFN 512, 6 layers, initializer_range 0.02)."""
    config = init_test_config()
    torch.manual_seed(0)
    model = NVEncodonForMaskedLM(config)
    gain = 0.02 * math.sqrt(math.log(12))
    layer = model.encodon.layers[0]
    qkv = layer.self_attention.layernorm_qkv.weight.detach().view(4, 3, 64, 256)  # [head, q/k/v, head_dim, hidden]
    expected = {
        "query": (qkv[:, 0], 1 / 16),  # Xavier, gain 1, fan_in = fan_out = 256
        "key": (qkv[:, 1], 1 / 16),
        "value": (qkv[:, 2], gain / 16),
        "fc1": (layer.mlp.fc1.weight, gain * math.sqrt(2 / (256 + 512))),
        "decoder": (model.lm_head.decoder.weight, gain * math.sqrt(2 / (256 + 69))),  # the unpadded vocabulary
        "embedding": (model.encodon.embeddings.word_embeddings.weight[4:], 0.02),
    }
    for name, (tensor, std) in expected.items():
        assert abs(tensor.std().item() / std - 1) < 0.05, (name, tensor.std().item(), std)


def test_the_published_init_passes_the_same_check():
    """The reference draws MAGNETO the published way (torch's xavier_normal_ by module name); converted, it passes the
    check the NV model passes: the shared check describes the published init, not just this package's."""
    reference_config = EncodonReferenceConfig(
        hidden_size=256, num_attention_heads=4, num_hidden_layers=6, intermediate_size=512
    )
    torch.manual_seed(0)
    reference = EncodonReference(reference_config)
    nv_model = convert_encodon_checkpoint_to_te(reference.state_dict(), hyper_parameters(reference), backend="torch")
    weights = dict(nv_model.named_parameters())
    for name in ("encodon.embeddings.word_embeddings.weight", "lm_head.decoder.weight"):
        weights[name] = weights[name][: nv_model.config.vocab_size]  # the conversion's zero padding is no init
    assert_initialised_as_configured(weights, nv_model.config)


def test_the_check_fails_on_a_swapped_qkv_block():
    """Values drawn with the query/key gain (1, not the scaled gain): the block-wise check must catch it."""
    config = init_test_config()
    torch.manual_seed(0)
    model = NVEncodonForMaskedLM(config)
    qkv = model.encodon.layers[1].self_attention.layernorm_qkv.weight.detach().view(4, 3, 64, 256)
    qkv[:, 2] = qkv[:, 0].clone()  # values now look like queries
    with pytest.raises(AssertionError, match="layers.1.self_attention.layernorm_qkv.weight"):
        assert_initialised_as_configured(dict(model.named_parameters()), config)
