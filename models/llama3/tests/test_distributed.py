"""Multi-process tests: FSDP2-sharded meta-device init with the init switches, and context parallelism (CPU
processes on gloo with the torch backend; 2 GPUs with TE)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


SCRIPTS = Path(__file__).parent / "scripts"
COMPONENT_DIR = Path(__file__).resolve().parents[1]


def _torchrun(script: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    python_path = os.pathsep.join([str(COMPONENT_DIR), str(COMPONENT_DIR / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*command, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_sharded_meta_init_on_cpu_two_processes():
    result = _torchrun("fsdp2_meta_init.py", 2, "torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_sharded_meta_init_with_te_two_gpus():
    result = _torchrun("fsdp2_meta_init.py", 2, "te")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


def test_context_parallel_matches_single_process_on_cpu_torch_backend():
    result = _torchrun("context_parallel.py", 2, "torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CP-OK" in result.stdout


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_context_parallel_matches_single_gpu_two_gpus():
    result = _torchrun("context_parallel.py", 2, "te")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CP-OK" in result.stdout
