"""scripts/step_benchmark.py on the CPU: the L0 model's step timed on random images, one JSON line of numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


RECIPE_DIR = Path(__file__).resolve().parents[1]


def test_step_benchmark_times_the_model_without_data():
    command = [
        sys.executable, str(RECIPE_DIR / "scripts" / "step_benchmark.py"), "--config", "L0_sanity", "--strategy",
        "ddp", "--steps", "3", "--warmup", "1", "--classes", "4", "--micro-batch", "8",
        "++model_config_overrides.backend=torch",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=RECIPE_DIR)
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["micro_batch_images"] == 8 and numbers["tokens_per_image"] == 65
    assert numbers["images_per_second"] == numbers["micro_batch_images"] / numbers["step_time_s"] > 0
    assert 0 < numbers["mfu"] < 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: Megatron-FSDP would run")
def test_step_benchmark_refuses_megatron_fsdp_without_a_gpu():
    command = [sys.executable, str(RECIPE_DIR / "scripts" / "step_benchmark.py"), "--config", "L0_sanity"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=RECIPE_DIR)
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr
