"""AMPLIFY under the shared model contract (tests/model_contract.py, a copy of common/tests/model_contract.py).

There is no AMPLIFY model in transformers, so the contract's "stock Hugging Face model" is the reference
implementation in ``amplify_reference.py``: written from the published architecture, it computes the interleaved
rotary layout itself and saves the published checkpoint layout, so the contract's logits, gradients, round-trip and
export tests compare the NV model with the published model. AMPLIFY's own tests are in the other test_*.py files.
"""

from functools import partial

import pytest
from amplify_testing import TINY_SHAPE, make_batch, nv_to_reference, reference_model, reference_to_nv, shape_of
from model_contract import *  # noqa: F403  (the contract's tests)
from model_contract import ModelContract
from model_contract_export import *  # noqa: F403  (its export part)
from model_contract_te import *  # noqa: F403  (its TE part, on GPU machines)
from transformers import AutoModelForMaskedLM

from amplify_te.export import export_hf_checkpoint, save_nv_checkpoint
from amplify_te.modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM


def init_config(**overrides) -> NVAmplifyConfig:
    return NVAmplifyConfig(
        **{**TINY_SHAPE, "hidden_size": 256, "intermediate_size": 512, "backend": "torch", **overrides}
    )


# The 120M width (head_dim 64, SwiGLU width 1712) with 2 of its 24 layers: the published shapes, at CPU-test cost.
WIDTH_120M = {**shape_of("AMPLIFY_120M"), "num_hidden_layers": 2}

CONTRACTS = {
    "amplify": ModelContract(
        name="amplify",
        hf_model=reference_model,
        reference_models={
            "120M-width": partial(reference_model, WIDTH_120M),
            # The optional norms the published configs switch the other way.
            "norm-after-embedding-no-final-norm": partial(
                reference_model, layer_norm_after_embedding=True, layer_norm_before_last_layer=False
            ),
        },
        nv_class=NVAmplifyForMaskedLM,
        hf_to_nv=reference_to_nv,
        nv_to_hf=nv_to_reference,
        export=export_hf_checkpoint,
        save_nv=save_nv_checkpoint,
        auto_class=AutoModelForMaskedLM,
        make_batch=make_batch,
        init_config=init_config,
        tokenizer_texts=("MKTAYIAKQRQISFVK", "MSEQ"),
        modeling_files=(
            "modeling_amplify_te.py",
            "configuration_amplify_te.py",
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
        te_hf_model=partial(reference_model, {**shape_of("AMPLIFY_120M"), "num_hidden_layers": 4}),
        te_checked_gradients=(
            "amplify.embeddings.weight",
            "amplify.layers.0.self_attention.layernorm_qkv.weight",
            "amplify.layers.2.layernorm_mlp.fc1_weight",
            "amplify.layers.3.self_attention.proj.weight",
            "decoder.weight",
        ),
    )
}


@pytest.fixture(params=sorted(CONTRACTS))
def contract(request) -> ModelContract:
    return CONTRACTS[request.param]
