"""Encodon under the shared model contract (tests/model_contract.py, a copy of common/tests/model_contract.py).

There is no Encodon model in transformers, so the contract's "stock Hugging Face model" is the reference
implementation in ``encodon_reference.py``: written from the published architecture (four LayerNorms per layer,
separate query/key/value projections, rotate_half rotary from a stored inv_freq, einsum attention) with the published
state-dict keys, so the contract's logits, gradients, round-trip and export tests compare the NV model with the
published model. Encodon's own tests are in the other test_*.py files.
"""

from functools import partial

import pytest
from codonfm_testing import TINY_SHAPE, make_batch, nv_to_reference, reference_model, reference_to_nv, shape_of
from model_contract import *  # noqa: F403  (the contract's tests)
from model_contract import ModelContract
from model_contract_export import *  # noqa: F403  (its export part)
from model_contract_te import *  # noqa: F403  (its TE part, on GPU machines)
from transformers import AutoModelForMaskedLM

from codonfm_te.export import export_hf_checkpoint, save_nv_checkpoint
from codonfm_te.modeling_codonfm_te import NVEncodonConfig, NVEncodonForMaskedLM


def init_config(**overrides) -> NVEncodonConfig:
    return NVEncodonConfig(
        **{**TINY_SHAPE, "hidden_size": 256, "intermediate_size": 512, "backend": "torch", **overrides}
    )


# The encodon_80m width (head_dim 128, FFN 4096) with 2 of its 6 layers: the published shapes at CPU-test cost.
WIDTH_80M = {**shape_of("encodon_80m"), "num_hidden_layers": 2}

CONTRACTS = {
    "codonfm": ModelContract(
        name="codonfm",
        hf_model=reference_model,
        reference_models={
            "80m-width": partial(reference_model, WIDTH_80M),
            "relu": partial(reference_model, hidden_act="relu"),
            "theta-1e5": partial(reference_model, rotary_theta=1e5),
        },
        nv_class=NVEncodonForMaskedLM,
        hf_to_nv=reference_to_nv,
        nv_to_hf=nv_to_reference,
        export=export_hf_checkpoint,
        save_nv=save_nv_checkpoint,
        auto_class=AutoModelForMaskedLM,
        make_batch=make_batch,
        init_config=init_config,
        tokenizer_texts=("ATGGCCAAGTTTGGACTGTAA", "ATGAAATGA"),
        modeling_files=(
            "modeling_codonfm_te.py",
            "configuration_codonfm_te.py",
            "encodon_layer.py",
            "torch_layers.py",
            "torch_attention.py",
            "torch_norm_linear.py",
            "packing.py",
            "meta_init.py",
            "activation_recompute.py",
            "layer_autocast.py",
        ),
        te_hf_model=partial(reference_model, {**shape_of("encodon_80m"), "num_hidden_layers": 4}),
    )
}


@pytest.fixture(params=sorted(CONTRACTS))
def contract(request) -> ModelContract:
    return CONTRACTS[request.param]
