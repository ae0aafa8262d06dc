"""Llama 3 under the shared model contract (tests/model_contract.py, a copy of common/tests/model_contract.py).

Two contracts, untied and tied embeddings, since tying changes conversion, export and init. Between them the stock
models cover MHA and GQA, default and Llama 3 rope scaling, tied and untied. Llama's own tests (generation and the KV
cache, rope bands, shift_labels, left padding against each sequence alone, init switches) are in the other files.
"""

from functools import partial

import pytest
import torch
from llama_testing import LLAMA3_ROPE, TINY_GQA_SHAPE, TINY_SHAPE, hf_llama_config, make_batch, randomize_, shape_of
from model_contract import *  # noqa: F403  (the contract's tests)
from model_contract import ModelContract
from model_contract_export import *  # noqa: F403  (its export part)
from model_contract_te import *  # noqa: F403  (its TE part, on GPU machines)
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llama3_te.convert import convert_llama_hf_to_te, convert_llama_te_to_hf
from llama3_te.export import export_hf_checkpoint, save_nv_checkpoint
from llama3_te.modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM


# Wide enough for TE's fused kernels to be the ones that run (head_dim 64), small enough to be quick.
TE_SHAPE = {**shape_of("llama3-tiny-nucleotide"), "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
SHAPES = {"mha": TINY_SHAPE, "gqa": TINY_GQA_SHAPE}
ROPES = {"rope": None, "llama3-rope": LLAMA3_ROPE}


def stock_model(shape: dict = TINY_GQA_SHAPE, rope: dict | None = LLAMA3_ROPE, tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    return randomize_(LlamaForCausalLM(hf_llama_config(rope, tie_word_embeddings=tie, **shape)), seed).eval()


def batch(lengths: list[int], seed: int = 0, padding_side: str = "right") -> dict:
    return dict(zip(("input_ids", "attention_mask", "labels"), make_batch(lengths, seed, padding_side)))


def init_config(tie: bool, **overrides) -> NVLlamaConfig:
    shape = {**TINY_GQA_SHAPE, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 256}
    if not tie:  # 8 layers with both init switches: output projections at 0.02 / sqrt(16), far from 0.02
        shape.update(num_hidden_layers=8, embedding_init_std=1.0, scale_output_projection_init=True)
    return NVLlamaConfig(**{**shape, "tie_word_embeddings": tie, "backend": "torch", **overrides})


def llama_contract(tie: bool, shape: str, rope: str) -> ModelContract:
    """``shape`` and ``rope`` name the tiny stock model; the other shape/rope pairs are reference models."""
    name = "llama3-tied" if tie else "llama3-untied"
    return ModelContract(
        name=name,
        hf_model=partial(stock_model, SHAPES[shape], ROPES[rope], tie),
        reference_models={
            f"{s}-{r}": partial(stock_model, SHAPES[s], ROPES[r], tie)
            for s in SHAPES
            for r in ROPES
            if (s, r) != (shape, rope)
        },
        nv_class=NVLlamaForCausalLM,
        hf_to_nv=convert_llama_hf_to_te,
        nv_to_hf=convert_llama_te_to_hf,
        export=export_hf_checkpoint,
        save_nv=save_nv_checkpoint,
        auto_class=AutoModelForCausalLM,
        make_batch=batch,
        init_config=partial(init_config, tie),
        tokenizer_texts=("ACGTTGCAACGTNNRY", "GATTACA"),
        modeling_files=(
            "modeling_llama_te.py",
            "configuration_llama_te.py",
            "llama_decoding.py",
            "torch_layers.py",
            "torch_attention.py",
            "torch_norm_linear.py",
            "packing.py",
            "meta_init.py",
            "activation_recompute.py",
            "layer_autocast.py",
            "layer_stack.py",
            "fused_residual_layer.py",
            "fp8_mlp.py",
            "residual_norm.py",
            "te_attention.py",
            "te_attention_backward.py",
            "packed_rope.py",
        ),
        te_hf_model=partial(stock_model, TE_SHAPE, LLAMA3_ROPE, tie),
        te_checked_gradients=(
            "model.embed_tokens.weight",
            "model.layers.0.self_attention.layernorm_qkv.weight",
            "model.layers.0.self_attention.layernorm_qkv.layer_norm_weight",
            f"model.layers.{TE_SHAPE['num_hidden_layers'] - 1}.layernorm_mlp.fc1_weight",
            "model.layers.2.self_attention.proj.weight",
            "model.norm.weight",
            "lm_head.weight",
        ),
        causal_lm=True,
        padding_sides=("right", "left"),
        supports_generate=True,
    )


CONTRACTS = {
    # GQA with Llama 3 rope scaling: the shape most likely to break a mapping.
    "llama3-untied": llama_contract(tie=False, shape="gqa", rope="llama3-rope"),
    "llama3-tied": llama_contract(tie=True, shape="mha", rope="rope"),
}


@pytest.fixture(params=sorted(CONTRACTS))
def contract(request) -> ModelContract:
    return CONTRACTS[request.param]
