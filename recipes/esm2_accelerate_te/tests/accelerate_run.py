"""Launch train.py the way a user does: ``accelerate launch --config_file accelerate_config/<name>.yaml train.py``."""

import json
import subprocess
import sys
from pathlib import Path

from launch import RECIPE_DIR, script_env


# A tiny ESM-2 / AMPLIFY shape on the shipped synthetic data: seconds per run on one CPU core.
TINY_ESM2 = (
    "+model_config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 256, num_attention_heads: 4}"
)
FAST = ["dataset.max_seq_length=128", "dataset.micro_batch_size=16", "dataset.token_budget=2048"]


def accelerate_launch(
    config_file: str,
    *overrides: str,
    num_processes: int = 1,
    env: dict | None = None,
    cpu_only: bool = True,
    expect_failure: bool = False,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"accelerate_config/{config_file}",
        "--num_processes",
        str(num_processes),
    ]
    if num_processes > 1:
        command += ["--main_process_port", "0"]  # a free port: parallel test runs cannot collide
    command += ["train.py", *overrides]
    result = subprocess.run(
        command,
        cwd=RECIPE_DIR,
        env=script_env(env, cpu_only),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if (result.returncode != 0) != expect_failure:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
        )
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def refusal_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line a refused launch printed."""
    errors = [line for line in result.stderr.splitlines() + result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]
