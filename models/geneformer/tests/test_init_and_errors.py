"""Config settings Geneformer's implementation cannot honour are named; the shipped shapes build with the parameter
counts of the stock ``BertForMaskedLM``; conversion errors name the weights. Meta-device init, backend selection,
quantized layers on the torch backend, bad THD input and the settings every model checks are in the model contract
(test_model_contract.py)."""

import json

import pytest
import torch
from geneformer_testing import MODEL_CONFIGS, TINY_SHAPE, stock_model
from transformers import BertConfig, BertForMaskedLM

from geneformer_te.convert import convert_geneformer_hf_to_te, convert_geneformer_te_to_hf
from geneformer_te.modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 65}, "divisible by num_attention_heads"),
        ({"hidden_act": "swiglu"}, "hidden_act must be one of"),
        ({"is_decoder": True}, "is an encoder"),
        ({"type_vocab_size": 0}, "type_vocab_size must be positive"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        NVGeneformerConfig(**{**TINY_SHAPE, "backend": "torch", **overrides})


def test_every_problem_is_named_at_once():
    with pytest.raises(ValueError, match="hidden_act.*is an encoder"):
        NVGeneformerConfig(**TINY_SHAPE, backend="torch", hidden_act="tanh", is_decoder=True)


def test_untied_decoder_is_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        convert_geneformer_hf_to_te(stock_model(tie_word_embeddings=False), backend="torch")


def test_the_stock_config_comes_back_without_nv_only_fields():
    """BERT -> NV -> BERT: not one config field more or less (no recompute switch in the stock config)."""
    stock = stock_model()
    nv_model = convert_geneformer_hf_to_te(stock, backend="torch", recompute_layers=1)
    assert convert_geneformer_te_to_hf(nv_model).config.to_diff_dict() == stock.config.to_diff_dict()


def test_a_checkpoint_with_more_layers_than_its_config_is_named():
    hf_model = stock_model(num_hidden_layers=3)
    hf_model.config.num_hidden_layers = 2  # a config.json that disagrees with its weights
    with pytest.raises(ValueError, match=r"does not know: \['bert\.encoder\.layer\.2\."):
        convert_geneformer_hf_to_te(hf_model, backend="torch")


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("geneformer_10M", (6, 256, 4, 512)),
        ("geneformer_106M", (12, 768, 12, 3072)),
        ("geneformer_4B", (36, 2560, 40, 10240)),
    ],
)
def test_shipped_shapes(name, shape):
    values = json.loads((MODEL_CONFIGS / name / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
    assert tuple(values[k] for k in keys) == shape
    assert (values["vocab_size"], values["max_position_embeddings"], values["hidden_act"]) == (25_426, 2048, "relu")
    assert (values["hidden_dropout_prob"], values["layer_norm_eps"]) == (0.02, 1e-12)


@pytest.mark.parametrize("name", ["geneformer_10M", "geneformer_106M"])
def test_shipped_shapes_have_the_stock_parameter_count(name):
    """The NV model (vocabulary padding excluded) has exactly the parameters of the stock BertForMaskedLM."""
    config = NVGeneformerConfig.from_pretrained(MODEL_CONFIGS / name, backend="torch")
    with torch.device("meta"):
        nv_model = NVGeneformerForMaskedLM(config)
        hf_model = BertForMaskedLM(
            BertConfig(**{k: v for k, v in config.to_dict().items() if k in BertConfig().to_dict()})
        )
    padding = (config.padded_vocab_size - config.vocab_size) * (config.hidden_size + 1)  # embedding rows, head bias
    hf_count = sum(p.numel() for p in hf_model.parameters())
    assert sum(p.numel() for p in nv_model.parameters()) - padding == hf_count
    expected = {"geneformer_10M": 10.3e6, "geneformer_106M": 105.5e6}[name]
    assert abs(hf_count - expected) / expected < 0.02, hf_count
