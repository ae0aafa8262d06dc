"""Context parallelism: a packed batch split over 2 ranks gives the logits, loss and gradients of one process (CPU
processes on gloo with the torch backend; 2 GPUs with TE). FSDP2-sharded meta init is in the model contract."""

import pytest
from model_contract import torchrun


def test_context_parallel_matches_single_process_on_cpu_torch_backend():
    result = torchrun("context_parallel_mlm.py", "torch", "amplify")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CP-OK" in result.stdout


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_context_parallel_matches_single_gpu_two_gpus():
    result = torchrun("context_parallel_mlm.py", "te", "amplify")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CP-OK" in result.stdout
