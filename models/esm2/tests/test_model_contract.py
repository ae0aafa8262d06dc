"""ESM-2 under the shared model contract (tests/model_contract.py, a copy of common/tests/model_contract.py).

The contract's tests are collected here; ESM-2's own tests (token dropout, token classification, the contact head,
config checks of its own) are in the other test_*.py files.
"""

from functools import partial

import pytest
import torch
from esm_testing import TINY_SHAPE, hf_esm2_config, make_batch, randomize_, shape_of
from model_contract import *  # noqa: F403  (the contract's tests)
from model_contract import ModelContract
from model_contract_export import *  # noqa: F403  (its export part)
from model_contract_te import *  # noqa: F403  (its TE part, on GPU machines)
from transformers import AutoModelForMaskedLM, EsmForMaskedLM

from esm2_te.convert import convert_esm_hf_to_te, convert_esm_te_to_hf
from esm2_te.export import export_hf_checkpoint, save_nv_checkpoint
from esm2_te.modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM


def stock_model(shape: dict = TINY_SHAPE, seed: int = 0) -> EsmForMaskedLM:
    torch.manual_seed(seed)
    return randomize_(EsmForMaskedLM(hf_esm2_config(**shape)), seed).eval()


def batch(lengths: list[int], seed: int = 0, padding_side: str = "right") -> dict:
    assert padding_side == "right", "ESM-2 batches are padded on the right"
    return dict(zip(("input_ids", "attention_mask", "labels"), make_batch(lengths, seed)))


def init_config(**overrides) -> NVEsmConfig:
    return NVEsmConfig(**{**TINY_SHAPE, "hidden_size": 256, "intermediate_size": 512, "backend": "torch", **overrides})


CONTRACTS = {
    "esm2": ModelContract(
        name="esm2",
        hf_model=stock_model,
        reference_models={
            "8M": partial(stock_model, shape_of("esm2_t6_8M_UR50D")),
            "35M": partial(stock_model, shape_of("esm2_t12_35M_UR50D")),
        },
        nv_class=NVEsmForMaskedLM,
        hf_to_nv=convert_esm_hf_to_te,
        nv_to_hf=convert_esm_te_to_hf,
        export=export_hf_checkpoint,
        save_nv=save_nv_checkpoint,
        auto_class=AutoModelForMaskedLM,
        make_batch=batch,
        init_config=init_config,
        tokenizer_texts=("MKTAYIAKQRQISFVK", "MSEQ"),
        modeling_files=(
            "modeling_esm_te.py",
            "configuration_esm_te.py",
            "torch_layers.py",
            "torch_attention.py",
            "torch_norm_linear.py",
            "packing.py",
            "meta_init.py",
            "te_attention.py",
            "te_attention_backward.py",
            "activation_recompute.py",
            "layer_autocast.py",
            "packed_rope.py",
            "fused_residual_layer.py",
            "fp8_mlp.py",
            "residual_norm.py",
        ),
        te_hf_model=partial(stock_model, shape_of("esm2_t6_8M_UR50D")),
        te_checked_gradients=(
            "esm.embeddings.word_embeddings.weight",
            "esm.encoder.layers.0.self_attention.layernorm_qkv.weight",
            "esm.encoder.layers.3.layernorm_mlp.fc1_weight",
            "esm.encoder.layers.5.self_attention.proj.weight",
            "lm_head.dense.weight",
        ),
    )
}


@pytest.fixture(params=sorted(CONTRACTS))
def contract(request) -> ModelContract:
    return CONTRACTS[request.param]
