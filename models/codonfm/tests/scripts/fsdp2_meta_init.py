# Copied from common/tests/scripts/fsdp2_meta_init.py — edit the source, then run ci/check_copies.py --fix
"""torchrun worker of the model contract: build the model on the meta device, shard every transformer layer and the
whole model with FSDP2, init_empty_weights(), then check the gathered full weights against a one-process init,
against the init the config describes, that no two ranks hold the same shard, and that a training step runs.
Prints STATS-OK on rank 0.

Arguments: mode and contract name. Mode is ``torch`` (torch backend, CPU processes on gloo), ``te`` (TE, one GPU
per rank on NCCL) or ``te-shared-gpu`` (TE, every rank on GPU 0 over gloo: the sharded TE init path on a one-GPU
machine). The contract (``CONTRACTS[name]`` in the model's tests/test_model_contract.py) says which model and config.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard


# The package under test and tests/, whether or not the package is pip-installed (a GPU machine may run the tests
# from a checkout).
COMPONENT_DIR = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(COMPONENT_DIR), str(COMPONENT_DIR / "tests")]
from init_statistics import assert_initialised_as_configured  # noqa: E402
from model_contract import transformer_layers  # noqa: E402
from test_model_contract import CONTRACTS  # noqa: E402


SEED = 0


def gather_full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor on CPU, gathered through pickled shards (works on NCCL and on gloo over GPUs)."""
    full = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), (name, type(param))
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, param.to_local().detach().cpu())
        full[name] = torch.cat(shards)
    return full


def main(mode: str, contract_name: str) -> None:
    contract = CONTRACTS[contract_name]
    dist.init_process_group(backend="nccl" if mode == "te" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "torch":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank if mode == "te" else 0)
        torch.cuda.set_device(device)
    config = contract.init_config(backend="torch" if mode == "torch" else "te")

    torch.manual_seed(SEED)  # the same seed everywhere, as a training script sets it
    with torch.device("meta"):
        model = contract.nv_class(config)
    # An explicit mesh: FSDP2's default mesh is on CUDA whenever a GPU exists, even for CPU (gloo) processes.
    mesh = init_device_mesh(device.type, (world,))
    for layer in transformer_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.init_empty_weights(device)
    sharded = gather_full_weights(model)

    # The reference: the same seed, one process, no sharding.
    torch.manual_seed(SEED)
    with torch.device("meta"):
        reference = contract.nv_class(config)
    reference.init_empty_weights(device)
    expected = {name: param.detach().cpu() for name, param in reference.named_parameters()}
    assert sharded.keys() == expected.keys(), sorted(sharded.keys() ^ expected.keys())
    for name, full in sharded.items():
        # Exactly the weights one process initialises from the same seed, whatever the number of ranks.
        assert torch.equal(full, expected[name]), f"{name}: differs from the one-process init"
        if full.dim() > 1:  # FSDP2 gives rank r the r-th chunk of dim 0: no two ranks may hold the same numbers
            shards = full.chunk(world)
            for i in range(len(shards)):
                for j in range(i + 1, len(shards)):
                    assert not torch.equal(shards[i], shards[j]), f"{name}: ranks {i} and {j} hold identical shards"
    assert_initialised_as_configured(sharded, config)

    if mode != "te-shared-gpu":  # that mode checks the init; training over gloo on one GPU is no real setup
        batch = {k: v.to(device) for k, v in contract.make_batch([32, 32]).items()}
        loss = model(**batch).loss
        loss.backward()
        assert torch.isfinite(loss)
    if rank == 0:
        print("STATS-OK")
    # Both ranks reach the end before either tears gloo down: a rank leaving early aborts the other's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Leave without interpreter finalization: there, gloo's worker threads can still hold collective work objects
    # whose destruction aborts the process (SIGABRT, "terminate called without an active exception") after the
    # work is done and reported; it hit CI about once in ten runs. Nothing is left to flush but stdout.
    sys.stdout.flush()
    os._exit(0)
