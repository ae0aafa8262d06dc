"""Helpers for the tests that run the training scripts: quick settings, the run itself, and reading what it wrote."""

import json
from pathlib import Path

from launch import assert_logs_read_well_off_a_terminal, run_script


# L0_sanity made quicker for tests: shorter windows and packs, fewer steps. The loss still has to pass ln 4.
FAST = [
    "dataset.max_seq_length=256",
    "dataset.window_overlap=16",
    "dataset.token_budget=512",
    "lr_scheduler_kwargs.num_decay_steps=50",
    "validation.max_batches=4",
    "logger.log_every=10",
]
LOSS_THRESHOLD = 1.0  # ln 4 = 1.386 for independent bases; the chain's entropy rate is ~0.48


def train(
    output_dir: Path, *overrides: str, nproc: int | None = None, script: str = "train_fsdp2.py", **kwargs
) -> list[dict]:
    """Run a training script like a user (torchrun for nproc, else plain python) and return metrics.jsonl."""
    result = run_script(script, f"output_dir={output_dir}", *FAST, *overrides, nproc=nproc, **kwargs)
    assert_logs_read_well_off_a_terminal(result)
    return read_jsonl(output_dir / "metrics.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
