"""Multi-process tests: FSDP2-sharded meta-device init and context parallelism (CPU processes and 2 GPUs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


SCRIPT = Path(__file__).parent / "scripts" / "fsdp2_meta_init.py"
COMPONENT_DIR = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, backend: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{COMPONENT_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(SCRIPT),
        backend,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_sharded_meta_init_on_cpu_two_processes():
    result = _torchrun(2, "torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_sharded_meta_init_with_te_two_gpus():
    result = _torchrun(2, "te")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


def _context_parallel(backend: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{COMPONENT_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = Path(__file__).parent / "scripts" / "context_parallel.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        backend,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_context_parallel_matches_single_process_on_cpu_torch_backend():
    result = _context_parallel("torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CP-OK" in result.stdout


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_context_parallel_matches_single_gpu_two_gpus():
    result = _context_parallel("te")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CP-OK" in result.stdout
