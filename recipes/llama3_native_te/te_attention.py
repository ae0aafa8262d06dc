# Copied from common/te_attention.py — edit the source, then run ci/check_copies.py --fix
"""Query, key and value for TE's attention as views of the fused QKV projection, with a backward that does not copy.

Where a ``TransformerLayer`` is called without a rotary embedding (Geneformer, which has none; ESM-2 and AMPLIFY,
whose QKV projection applies it itself: packed_rope.py), TE (2.20) hands its attention the fused QKV projection as
one packed tensor (``qkv_layer``), and ``DotProductAttention`` takes query, key and value out of it
with three ``Tensor.select`` calls. Autograd's backward of each select writes a zero-filled tensor the size of the
whole projection and copies its gradient into a third of it, and the three are then added: per layer, three fills,
three copies and two adds over [tokens, 3 * hidden], although attention's backward wrote dQ, dK and dV side by side
in one buffer already. Measured on one H100 (fwd + bwd + AdamW, bf16, back to back): Geneformer 106M with 64k
tokens 223 -> 208 ms per step, the same loss. (A bare ViT-B/16 step went from 83.5 to 74.3 ms too, but the ViT
recipe's Megatron-FSDP step did not get faster in a first, noisy comparison, so ViT does not use this yet.)

``split_packed_qkv(layers)`` gives every layer's attention a forward pre-hook that takes the packed tensor apart
itself (``SplitPackedQKV``: views of it, no copy) and passes query, key and value instead; TE finds that they share
one buffer and runs the same packed-layout kernels. Their backward returns attention's dQKV buffer as the
projection's gradient when dQ, dK and dV lie side by side in it (no copy), and stacks them otherwise.
"""

import inspect

import torch


class SplitPackedQKV(torch.autograd.Function):
    """``packed`` [..., 3, ...] -> (query, key, value): its three slices at index 0, 1, 2 of dimension ``dim``."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, dim: int):
        ctx.dim = dim % packed.dim()
        return tuple(packed.select(ctx.dim, index) for index in range(3))

    @staticmethod
    def backward(ctx, *grads):
        present = next(g for g in grads if g is not None)
        grads = [torch.zeros_like(present) if g is None else g for g in grads]
        packed = _side_by_side(grads, ctx.dim)
        return (packed if packed is not None else torch.stack(grads, dim=ctx.dim)), None


def _side_by_side(grads: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    """A view of the buffer whose slices 0, 1, 2 along ``dim`` are ``grads``, or None if they are not so laid out."""
    first = grads[0]
    step = grads[1].storage_offset() - first.storage_offset()
    for index, grad in enumerate(grads):
        if (
            grad.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or grad.shape != first.shape
            or grad.stride() != first.stride()
            or grad.dtype != first.dtype
            or grad.storage_offset() != first.storage_offset() + index * step
        ):
            return None
    shape, strides = list(first.shape), list(first.stride())
    shape.insert(dim, 3)
    strides.insert(dim, step)
    return first.as_strided(shape, strides, first.storage_offset()) if _no_overlap(shape, strides) else None


def _no_overlap(shape: list[int], strides: list[int]) -> bool:
    """True when every index of a view with these sizes and strides reaches its own element."""
    reach = 0  # the largest offset the smaller-stride dimensions reach
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _split_packed_qkv_hook(module, args, kwargs):
    packed = kwargs.get("qkv_layer")
    if packed is None or type(packed) is not torch.Tensor:  # no packed input, or an FP8 tensor: TE's own path
        return None
    query, key, value = SplitPackedQKV.apply(packed, kwargs.get("qkv_interleave_dim", -3))
    kwargs = {**kwargs, "qkv_layer": None}
    if len(args) >= 3:  # TE's MultiheadAttention passes query, key, value (None here) positionally
        return (query, key, value, *args[3:]), kwargs
    return args, {**kwargs, "query_layer": query, "key_layer": key, "value_layer": value}


def split_packed_qkv(layers) -> int:
    """Give the attention of every TE layer in ``layers`` the pre-hook described above; returns how many got it.

    A TE release whose ``DotProductAttention`` takes no ``qkv_layer`` passes query, key and value split already, so
    nothing is hooked there.
    """
    hooked = 0
    for layer in layers:
        for module in layer.modules():
            if type(module).__name__ != "DotProductAttention":
                continue
            if "qkv_layer" not in inspect.signature(module.forward).parameters:
                continue
            module.register_forward_pre_hook(_split_packed_qkv_hook, with_kwargs=True)
            hooked += 1
    return hooked
