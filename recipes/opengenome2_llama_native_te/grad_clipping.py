# Copied from common/grad_clipping.py — edit the source, then run ci/check_copies.py --fix
"""Gradient-norm clipping: the training step's clip-and-step, and the norm of Megatron-FSDP's sharded gradients.

``clip_grad_norm_and_step`` is what the training loops call between backward and the scheduler. It clips as
``torch.nn.utils.clip_grad_norm_`` does (the same norm, the same factor ``min(max_norm / (norm + 1e-6), 1)``), but an
optimizer that can scale the gradients as it reads them (``scales_gradients_in_step``: ``CompensatedAdamW``, the
recipes' AdamW on CUDA, adamw.py) gets the factor in its step instead of a pass that first rewrites every gradient in
place (for ESM-2 3B's bf16 gradients a read and a write of 5.7 GB per step). The gradients then stay unclipped. For
float32 gradients the clipped value is the same float32 product either way; bf16 gradients are not rounded to bf16
after scaling, so there steps that clip differ from in-place clipping by that rounding. Other optimizers (torch's
AdamW: CPU runs, or ``adamw_kwargs`` that ask for it) keep the in-place clipping.

Megatron-FSDP needs its own norm (``clip_sharded_grad_norm_``).

``torch.nn.utils.clip_grad_norm_`` reduces the norm of each DTensor gradient with collectives of its own. Megatron-FSDP
shards flat buffers, so a small parameter can lie wholly on one rank; on the others its ``.grad`` is None. The ranks
then issue different numbers of collectives and the job hangs (seen on 2 GPUs in the first step). Here the reductions
follow the *parameters*, which every rank has: each rank adds up the squares of the gradient elements it holds (none:
zero), one all-reduce per sharded mesh dimension makes the sum global, and every rank scales its own pieces.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_sharded_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Scale the gradients in place so that their global L2 norm is at most ``max_norm`` (None: only measure it);
    return the norm before clipping, a float32 scalar equal on every rank.

    Gradients may be plain tensors (replicated: counted once) or DTensors sharded over some mesh dimensions (their
    local pieces are summed over those dimensions). Call it on every rank with the same parameters.
    """
    parameters = list(parameters)
    if not parameters:
        raise ValueError("clip_sharded_grad_norm_ got no parameters")
    pieces_by_reduction: dict[tuple, list[torch.Tensor]] = {}  # in parameter order, so the same keys on every rank
    for param in parameters:
        pieces = pieces_by_reduction.setdefault(_reduction(param), [])
        if param.grad is not None:
            pieces.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)

    device = _local(parameters[0]).device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, sharded_dims), pieces in pieces_by_reduction.items():
        part = torch.zeros((), dtype=torch.float32, device=device)
        if pieces:
            # float32 norms straight from the kernel: bf16 gradients' norms would be rounded to bf16 and cast back
            # one by one (a cast kernel per tensor)
            part += torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32)).square().sum()
        for dim in sharded_dims:
            dist.all_reduce(part, group=mesh.get_group(dim))
        squares += part
    norm = squares.sqrt()

    if max_norm is not None:
        all_pieces = [piece for pieces in pieces_by_reduction.values() for piece in pieces]
        if all_pieces:
            torch._foreach_mul_(all_pieces, clip_factor(norm, max_norm))
    return norm


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping multiplies the gradients by, as torch's ``clip_grad_norm_`` computes it (on the device; a plain
    tensor also where the norm is a DTensor)."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return factor.full_tensor() if isinstance(factor, DTensor) else factor


def clip_grad_norm_and_step(
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    sharded: bool = False,
) -> torch.Tensor:
    """Clip the gradients' global L2 norm to ``max_norm`` (None: only measure it) and take ``optimizer``'s step;
    return the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.

    With ``optimizer.scales_gradients_in_step`` the factor goes to ``optimizer.step(grad_scale=...)`` and the
    gradients are left as they are; otherwise they are scaled in place and ``optimizer.step()`` runs. ``sharded``:
    Megatron-FSDP's gradients, whose norm ``clip_sharded_grad_norm_`` takes (call it on every rank)."""
    parameters = list(parameters)
    in_step = max_norm is not None and getattr(optimizer, "scales_gradients_in_step", False)
    if sharded:
        norm = clip_sharded_grad_norm_(parameters, None if in_step else max_norm)
    elif in_step or max_norm is None:
        norm = torch.nn.utils.get_total_norm([param.grad for param in parameters if param.grad is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    if in_step:
        optimizer.step(grad_scale=clip_factor(norm, max_norm))
    else:
        optimizer.step()
    return norm


def _reduction(param: torch.Tensor) -> tuple:
    """(mesh, the mesh dimensions it is sharded over) for a DTensor; (None, ()) for a plain, replicated tensor."""
    if not isinstance(param, DTensor):
        return None, ()
    if any(placement.is_partial() for placement in param.placements):
        raise ValueError(f"a parameter with placements {param.placements}: partial parameters are not supported")
    return param.device_mesh, tuple(dim for dim, placement in enumerate(param.placements) if placement.is_shard())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
