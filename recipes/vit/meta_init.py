# Copied from common/meta_init.py — edit the source, then run ci/check_copies.py --fix
"""Materialise a model built on the meta device so that, sharded or not, it holds the weights of one init.

FSDP2 turns each parameter into a DTensor whose local tensor is this rank's shard. Initialising those shards in
place goes wrong in two ways: TransformerEngine's ``reset_parameters`` fills only the local tensor from the global
generator, so ranks seeded alike (as training scripts seed them) write identical shards; and DTensor's own sharded
RNG exists only on CUDA, and even there the result depends on the number of ranks. Here every sharded parameter is
instead initialised as a full-size temporary tensor, one module at a time, by the module's own init code (TE,
the torch twins, or the model's ``_init_weights``), and each rank keeps its slice of it. All ranks draw from one
random stream, rank 0's, so the slices fit together into exactly the model that one process initialises: the same
weights on 1, 2 or N ranks for the same seed. Replicated mesh dimensions (HSDP) get identical replicas.

The temporary tensor costs one module's full-size parameters per rank for a moment, never the whole model.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def materialize_meta_model(model: nn.Module, device: torch.device | str, init_module: Callable[[nn.Module], None]):
    """Allocate ``model``'s parameters and buffers on ``device`` and run ``init_module`` on every sub-module.

    ``init_module(module)`` initialises the module's own parameters (``recurse=False``), as a Hugging Face
    ``_init_weights`` does. With a sharded model every rank must call this (it agrees on a seed with one broadcast
    per mesh dimension). The caller's random generators are left as they were, apart from one draw for the seed.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _to_empty_keeping_shared_parameters(model, device)
    with _one_random_stream(model, device):
        for module in model.modules():
            with _full_size_parameters(module):
                init_module(module)


def _to_empty_keeping_shared_parameters(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, with parameters shared between modules (tied embeddings) shared again after it.

    ``to_empty`` gives each module its own new tensor, which unties a plain model but not an FSDP2-sharded one; so
    the same init code would give the two different weights. Restoring the sharing makes them agree.
    """
    first_owner: dict[int, tuple[nn.Module, str]] = {}
    aliases = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first_owner:
                aliases.append((module, name, first_owner[id(param)]))
            else:
                first_owner[id(param)] = (module, name)
    model.to_empty(device=device)
    for module, name, (owner, owner_name) in aliases:
        module._parameters[name] = owner._parameters[owner_name]


@contextlib.contextmanager
def _one_random_stream(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Seed the generators that init code draws from (CPU, and ``device`` if it is a GPU) alike on every rank."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # from the caller's generator: seed-dependent init
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is not None:
        seed = _broadcast_from_mesh_origin(seed, mesh)
    cuda_devices = [device] if device.type == "cuda" else []
    # Only this rank's own GPU: touching every visible GPU would create a CUDA context on each of them.
    with torch.random.fork_rng(devices=cuda_devices):
        torch.random.default_generator.manual_seed(seed)
        if cuda_devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def _broadcast_from_mesh_origin(value: int, mesh) -> int:
    """The value held by the rank at mesh coordinate (0, ..., 0), on every rank of ``mesh``."""
    tensor = torch.tensor([value], dtype=torch.int64, device=mesh.device_type)
    # Broadcasting along each dimension in turn carries the origin's value to every coordinate.
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return int(tensor.item())


@contextlib.contextmanager
def _full_size_parameters(module: nn.Module) -> Iterator[None]:
    """Let ``module``'s own sharded parameters be full-size plain tensors; afterwards keep each rank's slice."""
    sharded = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    if not sharded:
        yield
        return
    if getattr(module, "primary_weights_in_fp8", False):
        raise NotImplementedError(
            f"{type(module).__name__}: sharded meta-device init does not support FP8 primary weights "
            "(te.quantized_model_init); build the model in high precision and let FP8 autocast quantize it"
        )
    for name, param in sharded.items():
        local = param.to_local()
        full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        yield
        with torch.no_grad():
            for name, param in sharded.items():
                full = module._parameters[name]  # init code may have re-wrapped it (TE does)
                shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
                # Keep attributes the init code set on the parameter (TE marks tensor-parallel layout there).
                for attribute, value in vars(full).items():
                    setattr(param, attribute, value)
    finally:
        for name, param in sharded.items():
            module._parameters[name] = param  # the sharded parameter FSDP2 knows, never a replacement
