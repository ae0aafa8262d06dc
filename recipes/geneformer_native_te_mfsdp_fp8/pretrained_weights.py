# Copied from common/pretrained_weights.py — edit the source, then run ci/check_copies.py --fix
"""Pretrained weights (fine-tuning) into a model that is whole, sharded by FSDP2, or sharded by Megatron-FSDP.

``load_full_weights(model, state, source)`` copies a full (unsharded) state dict into ``model``, every weight
exactly as given in ``state`` (cast to the parameter's dtype), and fails with the names of missing or unexpected keys
and of weights of another shape. TE's ``_extra_state`` (FP8 bookkeeping, not weights) is neither needed nor loaded.

- A whole model (DDP or one process): ``load_state_dict_exactly``.
- A sharded one: every rank takes from each full tensor the part its shard holds and copies it in. The shard's place
  in the full tensor comes from the shard sizes of the ranks before it, so FSDP2's even chunks (the last one shorter)
  and Megatron-FSDP's uneven row ranges alike are placed right. The filled state dict then goes through the model's
  own ``load_state_dict``, as a resume from a checkpoint does: under Megatron-FSDP that writes the fp32 main weights
  (the parameters its optimizer updates) and, through its load hook, the bf16 compute weights rounded from them.

Why not ``torch.distributed.checkpoint.state_dict.set_model_state_dict``: with the fused TE layers under FSDP2 it
failed at start, handing TE's attention an ``_extra_state`` it refuses ("Unsupported checkpoint format"; torch 2.11,
TE 2.20, one H200). And why after sharding for Megatron-FSDP: weights loaded into the model before reach its fp32 main
weights only through the bf16 compute weights, rounded.

``weights_on_the_host(model)`` keeps a model's own float32 initialisation for the same load after sharding:
Megatron-FSDP builds its fp32 main weights from the model it is given, which is already cast to bf16 by then.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from weight_conversion import load_state_dict_exactly


def load_full_weights(
    model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, keep: tuple[str, ...] = ()
) -> None:
    """Copy the full weights ``state`` into ``model`` (whole or sharded; see the module docstring).

    ``keep``: weights the model keeps as they are when ``state`` has none (e.g. a new classifier for another number of
    classes). Raises ValueError naming the keys that are missing or unexpected, or a weight whose shape differs;
    ``source`` names the checkpoint in the message. Collective for a sharded model: every rank of its mesh calls it.
    """
    targets = model.state_dict()
    kept = {key for key in keep if key not in state}
    if not any(isinstance(value, DTensor) for value in targets.values()):
        load_state_dict_exactly(model, {**state, **{key: targets[key] for key in kept}}, source)
        return
    # Megatron-FSDP's state dict keys are the model's under its wrapper's "module." prefix.
    names = {
        key: key.removeprefix("module.")
        for key in targets
        if not key.endswith("_extra_state") and key.removeprefix("module.") not in kept
    }
    shapes = {name: tuple(targets[key].shape) for key, name in names.items()}
    missing = sorted(name for name in shapes if name not in state)
    unexpected = sorted(k for k in state if k not in shapes and not k.endswith("_extra_state"))
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {shapes[k]}"
        for k, v in state.items()
        if k in shapes and tuple(v.shape) != shapes[k]
    ]
    problems = [
        f"{label} ({len(keys)}): {keys[:5]}{' ...' if len(keys) > 5 else ''}"
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", mismatched))
        if keys
    ]
    if problems:  # (the same words as load_state_dict_exactly's)
        raise ValueError(f"cannot load {source}: " + "; ".join(problems))
    loaded = {}
    with torch.no_grad():
        for key, name in names.items():
            target = targets[key]
            if isinstance(target, DTensor):
                target.to_local().copy_(state[name][_local_part(target)])
            else:
                target.copy_(state[name])
            loaded[key] = target
    model.load_state_dict(loaded, strict=False)  # (the _extra_state keys are left out on purpose)


def weights_on_the_host(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host-memory copy of ``model``'s whole state dict at its dtypes (TE's ``_extra_state`` left out), in the form
    ``load_full_weights`` takes: a model's float32 initialisation, kept past a cast to bf16 to be loaded exactly into
    Megatron-FSDP's fp32 main weights after sharding. It costs host memory of the model's size on every rank, until
    it is loaded."""
    return {
        key: value.detach().to("cpu", copy=True)
        for key, value in model.state_dict().items()
        if not key.endswith("_extra_state")
    }


def _local_part(sharded: DTensor) -> tuple[slice, ...]:
    """The index of this rank's shard of ``sharded`` in the full tensor: along each sharded dimension, the shards of
    the lower ranks come first (a collective over each mesh dimension that shards)."""
    local_shape = sharded.to_local().shape
    starts = [0] * len(local_shape)
    # One sharding mesh dimension of more than one rank (FSDP2; Megatron-FSDP without tensor parallelism): nested
    # shards of one tensor would need the order in which they were cut.
    sharding = [
        i for i, p in enumerate(sharded.placements) if isinstance(p, Shard) and sharded.device_mesh.size(i) > 1
    ]
    if len(sharding) > 1:
        raise NotImplementedError(f"a weight sharded over {len(sharding)} mesh dimensions ({sharded.placements})")
    for mesh_dim, placement in enumerate(sharded.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(f"a weight with placement {placement}")
        group = sharded.device_mesh.get_group(mesh_dim)
        sizes = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, local_shape[placement.dim], group=group)
        starts[placement.dim] += sum(sizes[: dist.get_rank(group)])
    return tuple(slice(start, start + size) for start, size in zip(starts, local_shape))
