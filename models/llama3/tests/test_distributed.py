"""Multi-process tests: FSDP2-sharded meta-device init with the init switches, and context parallelism (CPU
processes on gloo with the torch backend; 2 GPUs with TE)."""

import subprocess
import sys
from pathlib import Path

import pytest


SCRIPTS = Path(__file__).parent / "scripts"


def _torchrun(script: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    # The scripts put the package under test (and tests/) on sys.path themselves: nothing needs to be pip-installed.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run([*command, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300)


def test_sharded_meta_init_on_cpu_two_processes():
    result = _torchrun("fsdp2_meta_init.py", 2, "torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


@pytest.mark.requires_te
def test_sharded_meta_init_with_te_two_ranks_on_one_gpu():
    """The TE path of sharded init (each rank keeps its slice of one init) on a one-GPU machine: two gloo ranks."""
    result = _torchrun("fsdp2_meta_init.py", 2, "te-shared-gpu")
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
