# Copied from common/distributed.py — edit the source, then run ci/check_copies.py --fix
"""Process-group setup from torchrun's environment, device choice, device meshes and teardown.

Launched by ``torchrun`` the usual variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) are set and a process
group is created. Launched as ``python train_x.py`` none are set: the run is a world of one and, unless the caller
asks for one (FSDP2 needs a group even when alone), no process group exists and nothing calls into
``torch.distributed``.
"""

import inspect
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from user_errors import ConfigError


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in the job, read from torchrun's environment variables."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> "DistributedConfig":
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )

    @property
    def launched_by_torchrun(self) -> bool:
        return "WORLD_SIZE" in os.environ

    def is_main_process(self) -> bool:
        return self.rank == 0


def select_device(dist_config: DistributedConfig) -> torch.device:
    """One GPU per local rank when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", dist_config.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def setup_distributed(require_process_group: bool = False) -> tuple[DistributedConfig, torch.device]:
    """Read the environment, pick the device and, when launched by torchrun, initialise the process group.

    Args:
        require_process_group: also create a group for a plain ``python`` launch. Used by the FSDP entrypoints,
            whose sharding API needs a mesh even with one process; the group then lives in an in-process store,
            so no port is opened.
    """
    dist_config = DistributedConfig.from_env()
    device = select_device(dist_config)
    backend = "nccl" if device.type == "cuda" else "gloo"

    if dist.is_initialized():
        return dist_config, device
    if dist_config.launched_by_torchrun:
        # device_id binds NCCL's communicator to this GPU up front (and silences the "guessing device" warning).
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    elif require_process_group:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist_config.is_main_process():
        logger.info("world size %d, backend %s, device %s", dist_config.world_size, backend, device)
    return dist_config, device


@dataclass(frozen=True)
class Meshes:
    """The device meshes one run needs, kept together because flattened sub-meshes cannot be re-derived later.

    ``fsdp`` shards parameters, ``dp`` says which data shard a rank reads, ``cp`` (None without context
    parallelism) splits each sequence.
    """

    fsdp: DeviceMesh
    dp: DeviceMesh
    cp: DeviceMesh | None = None

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp.size()


def build_meshes(dist_config: DistributedConfig, device: torch.device, cp_size: int = 1) -> Meshes:
    """A ``("dp",)`` mesh, or with ``cp_size > 1`` a ``("dp", "cp")`` mesh plus its flattened ``"dp_cp"`` view.

    Ranks of one CP group hold pieces of the same sequences, so the data-parallel size is ``world_size // cp_size``:
    the dp dimension counts only groups that read different data. FSDP shards over both dimensions because CP
    ranks hold identical weights, so sharding over them too saves memory at no extra communication volume.
    """
    if cp_size < 1 or dist_config.world_size % cp_size != 0:
        raise ConfigError(
            f"cp_size={cp_size} must be >= 1 and divide the number of processes ({dist_config.world_size}): launch a "
            f"multiple of {cp_size} processes (torchrun --nproc_per_node=...) or pick a cp_size that divides "
            f"{dist_config.world_size}"
        )
    dp_size = dist_config.world_size // cp_size
    if cp_size == 1:
        mesh = init_device_mesh(device.type, (dp_size,), mesh_dim_names=("dp",))
        return Meshes(fsdp=mesh, dp=mesh)
    mesh = init_device_mesh(device.type, (dp_size, cp_size), mesh_dim_names=("dp", "cp"))
    return Meshes(fsdp=mesh["dp", "cp"]._flatten("dp_cp"), dp=mesh["dp"], cp=mesh["cp"])


def data_parallel_wrapper(
    model: torch.nn.Module, device: torch.device, float32_average: bool = False
) -> DistributedDataParallel | None:
    """``wrap_in_ddp(model, device, float32_average)`` when the default process group has more than one rank, else
    None.

    A process alone (``python train_ddp.py``, or ``torchrun --nproc_per_node=1``) has no gradients to average, and the
    wrapper would still copy every gradient into its communication buckets, "all-reduce" them over one rank and copy
    them back, and run its hooks in every backward: 1-2% of an ESM-2 650M step and 2.6 GB on one H100
    (docs/benchmarks.md).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        logger.info("One process: training the model without the DistributedDataParallel wrapper (nothing to average)")
        return None
    return wrap_in_ddp(model, device, float32_average)


def average_bf16_gradients_in_float32(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the bucket's (bf16) gradients cast to float32, averaged over the ranks in float32,
    and rounded back once, instead of summed in bf16 hop by hop (``mixed_precision.masters_in_optimizer``)."""
    group = process_group if process_group is not None else dist.group.WORLD
    wide = bucket.buffer().to(torch.float32).div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(done: torch.futures.Future) -> torch.Tensor:
        buffer = bucket.buffer()
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(narrow)


def wrap_in_ddp(
    model: torch.nn.Module, device: torch.device, float32_average: bool = False
) -> DistributedDataParallel:
    """``DistributedDataParallel`` over the default process group, without a buffer broadcast before every forward.

    Every rank builds the same buffers (rotary tables and the like) and training never changes them, so DDP's per-step
    broadcast would only cost time. torch 2.13 calls that ``forward_sync_buffers=False`` and warns on
    ``broadcast_buffers`` (deprecated there); older torch knows only ``broadcast_buffers=False``. (Either way the buffers
    are synced once at construction, like the weights: rank 0's copy.)
    """
    device_ids = [device.index] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        ddp = DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
    else:
        ddp = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
    if float32_average:  # bf16 gradients averaged in float32 (average_bf16_gradients_in_float32)
        ddp.register_comm_hook(None, average_bf16_gradients_in_float32)
    return ddp


def cleanup_distributed() -> None:
    """End a run's process group: wait for every rank, destroy the group, and on gloo end the process here.

    Call it last, once every output is written. With gloo (CPU runs) torch joins the group's worker threads in a
    C++ destructor that holds the GIL, while a worker still freeing the last collective's tensors waits for that
    GIL: the process hangs after its work is done (once in 20 two-process CPU runs here). So on gloo the logs are
    flushed and the process leaves with ``os._exit(0)`` before the objects holding the group (the DDP reducer, the
    device meshes) are freed. NCCL runs return normally.
    """
    if not dist.is_initialized():
        return
    uses_gloo = dist.get_backend() == "gloo"
    dist.barrier()  # a rank that leaves early would break the other ranks' teardown
    dist.destroy_process_group()
    if uses_gloo:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def move_to_device(batch: dict, device: torch.device) -> dict:
    """Move a batch's tensors to ``device`` (asynchronously from pinned memory); other values pass through."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
