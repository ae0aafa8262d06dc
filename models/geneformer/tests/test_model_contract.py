"""Geneformer under the shared model contract (tests/model_contract.py, a copy of common/tests/model_contract.py).

The stock Hugging Face model is ``BertForMaskedLM`` with Geneformer's settings (the published Geneformer checkpoints
are BertForMaskedLM). The contract's tests are collected here; Geneformer's own tests (token types, positions, the
tokenizer, the shipped shapes, config checks) are in the other test_*.py files.
"""

from functools import partial

import pytest
from geneformer_testing import TINY_SHAPE, VOCAB_SIZE, make_batch, shape_of, stock_model
from model_contract import *  # noqa: F403  (the contract's tests)
from model_contract import ModelContract
from model_contract_export import *  # noqa: F403  (its export part)
from model_contract_te import *  # noqa: F403  (its TE part, on GPU machines)
from transformers import AutoModelForMaskedLM

from geneformer_te.convert import convert_geneformer_hf_to_te, convert_geneformer_te_to_hf
from geneformer_te.export import export_hf_checkpoint, save_nv_checkpoint
from geneformer_te.modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM


def init_config(**overrides) -> NVGeneformerConfig:
    return NVGeneformerConfig(
        **{
            **TINY_SHAPE,
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 256,
            "intermediate_size": 512,
            "max_position_embeddings": 256,
            "backend": "torch",
            **overrides,
        }
    )


CONTRACTS = {
    "geneformer": ModelContract(
        name="geneformer",
        hf_model=stock_model,
        reference_models={
            "10M-width": partial(stock_model, **{**shape_of("geneformer_10M"), "num_hidden_layers": 2}),
            "gelu": partial(stock_model, hidden_act="gelu"),
        },
        nv_class=NVGeneformerForMaskedLM,
        hf_to_nv=convert_geneformer_hf_to_te,
        nv_to_hf=convert_geneformer_te_to_hf,
        export=export_hf_checkpoint,
        save_nv=save_nv_checkpoint,
        auto_class=AutoModelForMaskedLM,
        make_batch=make_batch,
        init_config=init_config,
        tokenizer_texts=("17 523 9 44 5 981", "300 2"),
        modeling_files=(
            "modeling_geneformer_te.py",
            "configuration_geneformer_te.py",
            "torch_layers.py",
            "torch_attention.py",
            "torch_norm_linear.py",
            "packing.py",
            "meta_init.py",
            "te_attention.py",
            "te_attention_backward.py",
            "activation_recompute.py",
            "layer_autocast.py",
        ),
        te_hf_model=partial(stock_model, **{**shape_of("geneformer_10M"), "num_hidden_layers": 4}),
        rotary=False,
        # ReLU and post-norm make bf16 gradients of this model noisy in either backend: measured on 1xH100 against
        # the fp32 gradients of the same weights, the worst parameter is 9.0% off with the torch twins and 8.9% with
        # TE (TE vs torch: 6.3%), where ESM-2's GELU pre-norm layers stay within 5%. So 8% here, not the default 5%.
        bf16_grad_tolerance=0.08,
        te_checked_gradients=(
            "bert.embeddings.word_embeddings.weight",
            "bert.embeddings.position_embeddings.weight",
            "bert.encoder.layers.0.self_attention.qkv.weight",
            "bert.encoder.layers.2.layernorm_mlp.fc1_weight",
            "bert.encoder.layers.3.self_attention.proj.weight",
            "bert.encoder.layers.3.layernorm.weight",
            "lm_head.dense.weight",
        ),
    )
}


@pytest.fixture(params=sorted(CONTRACTS))
def contract(request) -> ModelContract:
    return CONTRACTS[request.param]
