"""AMPLIFY on GPUs with the TransformerEngine backend (skipped on machines without them): the L0_sanity_amplify model
(AMPLIFY at ESM-2 8M's size) for 150 steps, with the CPU tests' references: loss below the residue background
entropy (~2.9 nats) and an export that reproduces the checkpointed weights."""

import importlib.util

import pytest
from test_train import LOSS_THRESHOLD, assert_export_reproduces_checkpoint
from test_train_gpu import assert_learned, train_on_gpu


L0_AMPLIFY = "L0_sanity_amplify"
STEPS = 150
# L0_sanity_amplify's shape, as overrides of L0_sanity_cp (which sets model_config_overrides.backend).
L0_AMPLIFY_SHAPE = [
    "+model_config_overrides.hidden_size=320",
    "+model_config_overrides.num_hidden_layers=6",
    "+model_config_overrides.num_attention_heads=20",
    "+model_config_overrides.intermediate_size=1248",
]


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", ["dataset.input_format=bshd"]),
        ("train_fsdp2.py", ["dataset.input_format=thd"]),
        # FusedResidualTransformerLayer (residual adds inside the RMSNorm kernels) in place of TE's layer
        ("train_ddp.py", ["dataset.input_format=thd", "+model_config_overrides.fused_residual_norm=true"]),
        ("train_fsdp2.py", ["dataset.input_format=bshd", "+model_config_overrides.fused_residual_norm=true"]),
    ],
)
def test_te_backend_learns_and_exports(tmp_path, script, overrides):
    metrics = train_on_gpu(
        script, tmp_path, "+model_config_overrides.backend=te", *overrides, steps=STEPS, config_name=L0_AMPLIFY
    )
    assert_learned(metrics, threshold=LOSS_THRESHOLD)
    assert_export_reproduces_checkpoint(tmp_path, step=STEPS)


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_layers_learn(tmp_path, recipe):
    overrides = [
        "dataset.input_format=thd",
        "dataset.pad_to_multiple_of=16",
        "fp8_config.enabled=true",
        f"fp8_config.fp8_recipe={recipe}",
        "fp8_config.keep_first_last_bf16=1",  # layers 2..5 in FP8
    ]
    metrics = train_on_gpu("train_fsdp2.py", tmp_path, *overrides, steps=STEPS, config_name=L0_AMPLIFY)
    assert_learned(
        metrics, threshold=2.9, last_steps=40
    )  # FP8 steps are noisier: the background entropy still needs context
    assert_export_reproduces_checkpoint(tmp_path, step=STEPS)


@pytest.mark.requires_gpu
@pytest.mark.skipif(importlib.util.find_spec("megatron_fsdp") is None, reason="megatron-fsdp is not installed")
@pytest.mark.parametrize("fused_residual_norm", [False, True])
def test_megatron_fsdp_learns_and_exports(tmp_path, fused_residual_norm):
    metrics = train_on_gpu(
        "train_mfsdp.py",
        tmp_path,
        "dataset.input_format=thd",
        f"+model_config_overrides.fused_residual_norm={str(fused_residual_norm).lower()}",
        nproc=1,
        steps=STEPS,
        config_name=L0_AMPLIFY,
    )
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=STEPS)


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_context_parallel_learns_and_exports(tmp_path):
    """L0_sanity_cp's split (2 ranks per sequence, ring attention) with the AMPLIFY model."""
    overrides = ["model_tag=model_configs/AMPLIFY_120M", *L0_AMPLIFY_SHAPE]
    metrics = train_on_gpu("train_cp.py", tmp_path, *overrides, nproc=2, steps=STEPS, config_name="L0_sanity_cp")
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=STEPS)
