"""The training scripts on GPUs with the TransformerEngine backend (skipped on machines without them).

References are those of the CPU tests: the loss must fall below ln 4 (which needs context) and the export must load
with the checkpoint's logits.
"""

import json
from pathlib import Path

import pytest
from launch import run_script
from test_train import FAST, LOSS_THRESHOLD, read_metrics


def train_on_gpu(script: str, output_dir: Path, *overrides: str, nproc: int | None = None) -> list[dict]:
    run_script(
        script, f"output_dir={output_dir}", *FAST, "num_train_steps=80", *overrides, nproc=nproc, cpu_only=False
    )
    return read_metrics(output_dir)


def assert_learned(metrics: list[dict], threshold: float = LOSS_THRESHOLD) -> None:
    assert metrics[-1]["loss"] < threshold, [round(m["loss"], 3) for m in metrics]


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", ["dataset.input_format=bshd", "dataset.micro_batch_size=8"]),
        ("train_fsdp2.py", ["dataset.input_format=thd"]),
        # bf16 weights, sharded: CompensatedAdamW's Triton kernel updates each local shard.
        ("train_fsdp2.py", ["dataset.input_format=thd", "mixed_precision.fp32_master_weights=false"]),
        # FusedResidualTransformerLayer (GQA, causal, RoPE in the QKV buffer), packed and padded input.
        ("train_ddp.py", ["dataset.input_format=thd", "+model_config_overrides.fused_residual_norm=true"]),
        ("train_fsdp2.py", ["dataset.input_format=bshd", "+model_config_overrides.fused_residual_norm=true"]),
    ],
    ids=["ddp-bshd", "fsdp2-thd", "fsdp2-thd-bf16-weights", "ddp-thd-fused", "fsdp2-bshd-fused"],
)
def test_te_backend_learns(tmp_path, script, overrides):
    metrics = train_on_gpu(script, tmp_path, "+model_config_overrides.backend=te", *overrides)
    assert_learned(metrics)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gb"] > 0
    assert (tmp_path / "final_model" / "model.safetensors").is_file()


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_learns(tmp_path, recipe):
    overrides = ["fp8_config.enabled=true", f"fp8_config.fp8_recipe={recipe}", "+model_config_overrides.backend=te"]
    assert_learned(train_on_gpu("train_fsdp2.py", tmp_path, *overrides), threshold=1.3)


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_two_gpus_fsdp2_learns(tmp_path):
    assert_learned(train_on_gpu("train_fsdp2.py", tmp_path, "dataset.input_format=thd", nproc=2))


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_context_parallel_two_gpus_learns_and_exports(tmp_path):
    """TE ring attention (cp_size=2, THD) on 2 GPUs; the CPU twin of this test proves CP = one process numerically."""
    metrics = train_on_gpu("train_cp.py", tmp_path, "model_config_overrides.backend=te", "cp_size=2", nproc=2)
    assert_learned(metrics)
    assert (tmp_path / "final_model" / "model.safetensors").is_file()
