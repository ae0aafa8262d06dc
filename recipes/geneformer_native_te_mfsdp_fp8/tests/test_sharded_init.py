# Copied from common/tests/test_sharded_init.py — edit the source, then run ci/check_copies.py --fix
"""FSDP2 meta-device init through ``train_fsdp2.py`` as a user runs it: N ranks initialise the model one rank does.

``num_train_steps=0`` makes the entrypoint build the model on the meta device, shard it, initialise each rank's
shards and export the gathered full weights untouched. The references are independent of the code under test:
a one-process run of the same config and seed (the weights must be identical), the init written in the model's
config.json (each matrix's std within sampling error, norm weights 1, biases 0), and the ranks' shards of every
matrix, no two of which may be equal.
"""

import json
from pathlib import Path

import pytest
import torch
from init_statistics import assert_initialised_as_configured
from launch import run_script
from safetensors.torch import load_file


def initial_weights(output_dir: Path, *overrides: str, nproc: int, gpu: bool = False):
    """(weights, config) of the model ``train_fsdp2.py`` initialises (L0_sanity config, nothing trained)."""
    run_script(
        "train_fsdp2.py",
        f"output_dir={output_dir}",
        "num_train_steps=0",
        "checkpoint.resume=false",
        *overrides,
        nproc=nproc,
        cpu_only=not gpu,
        timeout=600,
    )
    export = output_dir / "final_model"
    return load_file(export / "model.safetensors"), json.loads((export / "config.json").read_text())


def test_two_processes_initialise_the_one_process_model(tmp_path):
    one, config = initial_weights(tmp_path / "one", nproc=1)
    two, _ = initial_weights(tmp_path / "two", nproc=2)
    assert two.keys() == one.keys()
    for name in one:
        assert torch.equal(two[name], one[name]), f"{name}: 2 processes initialised other weights than 1"
    assert_initialised_as_configured(two, config, ranks=2)


@pytest.mark.requires_te
def test_te_init_on_one_gpu_equals_the_torch_backend(tmp_path):
    """TE's layers, initialised on the GPU, hold the numbers the torch twins draw there from the same seed."""
    te, config = initial_weights(tmp_path / "te", "++model_config_overrides.backend=te", nproc=1, gpu=True)
    twins, _ = initial_weights(tmp_path / "torch", "++model_config_overrides.backend=torch", nproc=1, gpu=True)
    assert te.keys() == twins.keys()
    for name in te:
        assert torch.equal(te[name], twins[name]), f"{name}: TE and torch backends initialised it differently"
    # One GPU holds it all; the two halves of every matrix must still differ (no repeated block).
    assert_initialised_as_configured(te, config, ranks=2)


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
@pytest.mark.parametrize("gpus", [2, 4])
def test_te_init_on_several_gpus_equals_one_gpu(tmp_path, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    overrides = ["++model_config_overrides.backend=te"]
    one, config = initial_weights(tmp_path / "one", *overrides, nproc=1, gpu=True)
    many, _ = initial_weights(tmp_path / "many", *overrides, nproc=gpus, gpu=True)
    assert many.keys() == one.keys()
    for name in one:
        assert torch.equal(many[name], one[name]), f"{name}: {gpus} GPUs initialised other weights than 1"
    assert_initialised_as_configured(many, config, ranks=gpus)
