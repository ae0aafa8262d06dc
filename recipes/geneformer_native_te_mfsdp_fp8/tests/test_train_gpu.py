"""The training scripts on a GPU with the TransformerEngine backend (skipped on machines without them).

The L0 sanity model trains for 100 steps; the references are the same as on CPU: the loss must fall well below the
masked genes' unigram entropy, the export must reproduce the checkpointed weights, and the held-out loss logged at
steps 50 and 100 must fall below that entropy too and (bf16) equal the export's evaluated on CPU to bf16 precision.
Megatron-FSDP, the recipe's main entrypoint, runs here with bf16 and with FP8; the benchmark configs run a few steps
at full size.
"""

import importlib.util
import json
from pathlib import Path

import pytest
from launch import run_script
from test_train import (
    LOSS_THRESHOLD,
    assert_export_reproduces_checkpoint,
    assert_validation_is_the_exports_held_out_loss,
    read_metrics,
    validation_records,
)


needs_megatron_fsdp = pytest.mark.skipif(
    importlib.util.find_spec("megatron_fsdp") is None, reason="megatron-fsdp is not installed"
)
FP8 = ["fp8_config.enabled=true", "dataset.pad_to_multiple_of=16"]
# L0_sanity's batching and its held-out cells, scored at steps 50 and 100 (VALIDATE) instead of 75, so that the last
# record is the exported model's.
L0_BATCHING = {"max_seq_length": 512, "micro_batch_size": 48, "token_budget": 2048}
VALIDATE = "validation.every_n_steps=50"


def assert_validated(output_dir: Path, steps: list[int]) -> None:
    """validation.jsonl holds ``steps`` and the held-out loss fell below the unigram entropy by more than a nat (FP8
    runs: their evaluation is not compared with the export's in float32)."""
    records = validation_records(output_dir)
    assert [r["step"] for r in records] == steps
    assert records[-1]["val_loss"] < min(records[0]["val_loss"], LOSS_THRESHOLD), records


def train_on_gpu(
    script: str, output_dir: Path, *overrides: str, nproc: int | None = 1, steps: int = 100, config: str | None = None
) -> list:
    """``steps`` steps, logged every 10, with a checkpoint halfway (the export is compared with the last one)."""
    # Hydra's --config-name goes before the overrides: argparse takes no positional arguments after an option.
    config_name = ["--config-name", config] if config else []
    schedule = [f"num_train_steps={steps}", "logger.log_every=10", f"checkpoint.save_every={steps // 2}"]
    args = [*config_name, f"output_dir={output_dir}", *schedule, *overrides]
    run_script(script, *args, nproc=nproc, cpu_only=False, timeout=600)
    return read_metrics(output_dir)


def assert_learned(metrics: list[dict], threshold: float = LOSS_THRESHOLD, last_steps: int = 20) -> None:
    final = [m["loss"] for m in metrics if m["step"] > metrics[-1]["step"] - last_steps]
    assert sum(final) / len(final) < threshold, [round(m["loss"], 3) for m in metrics]


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", ["dataset.input_format=bshd"]),
        ("train_fsdp2.py", ["dataset.input_format=thd"]),
        # bf16 weights, sharded: CompensatedAdamW's Triton kernel updates each local shard.
        ("train_fsdp2.py", ["dataset.input_format=thd", "mixed_precision.fp32_master_weights=false"]),
        pytest.param("train_mfsdp.py", ["dataset.input_format=thd"], marks=needs_megatron_fsdp),
    ],
)
def test_te_backend_learns_and_exports(tmp_path, script, overrides):
    metrics = train_on_gpu(script, tmp_path, "++model_config_overrides.backend=te", VALIDATE, *overrides)
    assert_learned(metrics)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gb"] > 0 and summary["median_mfu"] > 0
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    input_format = next(o.split("=")[1] for o in overrides if o.startswith("dataset.input_format="))
    assert_validation_is_the_exports_held_out_loss(tmp_path, [50, 100], L0_BATCHING, input_format, rel=0.02)


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_layers_learn_with_megatron_fsdp(tmp_path, recipe):
    if importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    metrics = train_on_gpu("train_mfsdp.py", tmp_path, *FP8, f"fp8_config.fp8_recipe={recipe}", VALIDATE)
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated(tmp_path, [50, 100])


@pytest.mark.requires_fp8
def test_fp8_with_bshd_input_and_bf16_first_last_layers(tmp_path):
    overrides = ["dataset.input_format=bshd", "fp8_config.enabled=true", "fp8_config.fp8_recipe=Float8CurrentScaling"]
    overrides += ["++model_config_overrides.num_hidden_layers=4", "fp8_config.keep_first_last_bf16=1"]
    assert_learned(train_on_gpu("train_ddp.py", tmp_path, *overrides, VALIDATE))
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated(tmp_path, [50, 100])


@pytest.mark.requires_fp8
@pytest.mark.parametrize(("config", "fp8"), [("10m", True), ("106m", False), ("106m", True)])
def test_benchmark_configs_run_at_full_size(tmp_path, config, fp8):
    """A few steps of the full-size shape on the synthetic cells (2,048-gene budget), to the final export, with a
    held-out pass at the last step."""
    if importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    overrides = [
        "dataset.path=data/sanity_cells.parquet",
        "validation.path=data/sanity_cells_val.parquet",
        "validation.every_n_steps=10",
        "lr_scheduler_kwargs.num_warmup_steps=2",
        "logger.log_every=1",
    ]
    overrides += FP8 if fp8 else []
    metrics = train_on_gpu("train_mfsdp.py", tmp_path, *overrides, steps=10, config=config)
    assert metrics[-1]["step"] == 10 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (tmp_path / "final_model" / "model.safetensors").is_file()
    assert [r["step"] for r in validation_records(tmp_path)] == [10]


@pytest.mark.requires_multi_gpu
@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py", "train_mfsdp.py"])
def test_two_gpus_learn(tmp_path, script):
    if script == "train_mfsdp.py" and importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    assert_learned(train_on_gpu(script, tmp_path, "dataset.input_format=thd", VALIDATE, nproc=2))
    if script == "train_mfsdp.py":  # the sharded checkpoint and the gathered export, written by two ranks
        assert_export_reproduces_checkpoint(tmp_path, step=100)
    # The held-out cells split over the two GPUs: together, what one CPU process computes for the export.
    assert_validation_is_the_exports_held_out_loss(tmp_path, [50, 100], L0_BATCHING, "thd", rel=0.02)
