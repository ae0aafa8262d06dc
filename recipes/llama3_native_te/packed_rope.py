# Copied from common/packed_rope.py — edit the source, then run ci/check_copies.py --fix
"""Rotary embeddings applied to the packed QKV projection of a TE layer: one Triton kernel each way.

For THD input, TE's ``TransformerLayer`` splits its fused QKV projection into query, key and value views, rotates
query and key with one RoPE kernel each (reading the strided views, writing new tensors), hands attention three
separate tensors, and in the backward concatenates dQ, dK and dV into the projection's gradient again. For a layer
whose projection lays every head out as [query, key, value] (``qkv_weight_interleaved=True``: [tokens, heads, 3,
head_dim]), ``PackedQKVRotary`` instead rotates query and key inside the projection's output buffer, right after
the projection (a forward hook on ``self_attention.layernorm_qkv``; the values are not touched), and the layer is
called without ``rotary_pos_emb``: TE then passes that buffer to attention as one packed QKV tensor (no split, no
copies), and the backward rotates attention's packed gradient in place into the projection's, in one pass.

With grouped-query attention (Llama: ``num_gqa_groups`` key/value heads shared by ``heads / groups`` query heads
each) TE's interleaved projection lays every group out as [its query heads..., key, value] ([tokens, groups, heads /
groups + 2, head_dim]); the kernel then rotates the first ``heads / groups + 1`` heads of every group. Multi-head
attention is the case of one query head per group.

There TE's attention cannot read the query heads as a view (a group's query heads are not evenly spaced in the
buffer), so a layer would rotate in place and then copy query, key and value out (and concatenate their gradients
back). ``rotate_split_qkv`` does both in one pass each way instead: it reads the projection once and writes the
rotated query and key and the value as three contiguous tensors, and its backward writes attention's dQ, dK and dV
back into the grouped layout, rotated by the opposite angle. ``FusedResidualTransformerLayer`` takes this path with
grouped-query attention (``PackedQKVRotary.attach`` hands its attention the rotary instead of hooking the projection).
Same values bit for bit as the in-place rotation followed by the copies.

The rotation is the half-split form (channel ``i`` pairs with ``i + head_dim / 2``, ESM-2's and TE's default). Each
token is rotated by the angles of its position within its own sequence, ``position * inv_freq``, from float32 cos/sin
tables that torch computes from the same angles the TE path uses; the arithmetic is float32, the result is rounded
to the buffer's dtype once, as in TE's kernel.

Without Triton (``available()`` is False) the models keep TE's RoPE. ``TRITON_INTERPRET=1`` runs the kernel on CPU
tensors (tests).
"""

import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs; the TE backend that needs this runs on CUDA, where torch brings Triton
    triton = None


def available() -> bool:
    return triton is not None


def supports(head_dim: int) -> bool:
    """The kernel handles half a head in one block: head_dim / 2 must be a power of two (16, 32, 64, ...)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and (half & (half - 1)) == 0


_KERNEL = None


def _kernel():
    """The Triton kernel, JIT-decorated on first use (so that ``TRITON_INTERPRET`` set by a test is honoured)."""
    global _KERNEL
    if _KERNEL is None:

        def rotate_query_key(
            qkv_ptr,
            positions_ptr,
            cos_ptr,
            sin_ptr,
            token_stride,
            num_groups,
            group_stride,
            HALF: tl.constexpr,
            BLOCK_GROUPS: tl.constexpr,
            ROTATED: tl.constexpr,
            INVERSE: tl.constexpr,
        ):
            # One program per token: the first ROTATED heads (queries, then the key) of every group, [BLOCK_GROUPS,
            # HALF] at a time, rotated where they lie; the value head is neither read nor written.
            token = tl.program_id(0).to(tl.int64)
            position = tl.load(positions_ptr + token).to(tl.int64)
            channels = tl.arange(0, HALF)
            cos = tl.load(cos_ptr + position * HALF + channels)[None, :]
            sin = tl.load(sin_ptr + position * HALF + channels)[None, :]
            if INVERSE:  # the backward rotates the gradient by the opposite angle
                sin = -sin
            groups = tl.arange(0, BLOCK_GROUPS)[:, None]
            mask = groups < num_groups
            offsets = token * token_stride + groups * group_stride + channels[None, :]
            for part in tl.static_range(ROTATED):  # each query head of the group, then its key head
                first = offsets + part * (2 * HALF)
                x1 = tl.load(qkv_ptr + first, mask=mask).to(tl.float32)
                x2 = tl.load(qkv_ptr + first + HALF, mask=mask).to(tl.float32)
                tl.store(qkv_ptr + first, (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)
                tl.store(qkv_ptr + first + HALF, (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)

        _KERNEL = triton.jit(rotate_query_key)
    return _KERNEL


_SPLIT_KERNEL = None


def _split_kernel():
    """The rotate-and-split kernel (grouped buffer <-> three tensors), JIT-decorated on first use as ``_kernel``."""
    global _SPLIT_KERNEL
    if _SPLIT_KERNEL is None:

        def rotate_split_grouped_qkv(
            grouped_ptr,
            query_ptr,
            key_ptr,
            value_ptr,
            positions_ptr,
            cos_ptr,
            sin_ptr,
            grouped_token_stride,
            group_stride,
            query_token_stride,
            query_head_stride,
            key_token_stride,
            key_head_stride,
            value_token_stride,
            value_head_stride,
            num_groups,
            HALF: tl.constexpr,
            BLOCK_GROUPS: tl.constexpr,
            PER_GROUP: tl.constexpr,
            TO_GROUPED: tl.constexpr,
        ):
            # One program per token. Forward (TO_GROUPED false): every group's query heads, key head and value head
            # are read from the grouped buffer and written to query [tokens, heads, d], key and value [tokens,
            # groups, d], queries and keys rotated. Backward (TO_GROUPED true): the same addresses the other way,
            # rotated by the opposite angle, so the grouped gradient is written in full.
            token = tl.program_id(0).to(tl.int64)
            position = tl.load(positions_ptr + token).to(tl.int64)
            channels = tl.arange(0, HALF)
            cos = tl.load(cos_ptr + position * HALF + channels)[None, :]
            sin = tl.load(sin_ptr + position * HALF + channels)[None, :]
            if TO_GROUPED:
                sin = -sin
            groups = tl.arange(0, BLOCK_GROUPS)[:, None]
            mask = groups < num_groups
            grouped = token * grouped_token_stride + groups * group_stride + channels[None, :]
            for part in tl.static_range(PER_GROUP + 2):  # each query head of the group, its key head, its value head
                if part < PER_GROUP:
                    other_ptr = query_ptr
                    other = token * query_token_stride + (groups * PER_GROUP + part) * query_head_stride
                elif part == PER_GROUP:
                    other_ptr = key_ptr
                    other = token * key_token_stride + groups * key_head_stride
                else:
                    other_ptr = value_ptr
                    other = token * value_token_stride + groups * value_head_stride
                other = other + channels[None, :]
                here = grouped + part * (2 * HALF)
                if TO_GROUPED:
                    source_ptr, source, target_ptr, target = other_ptr, other, grouped_ptr, here
                else:
                    source_ptr, source, target_ptr, target = grouped_ptr, here, other_ptr, other
                x1 = tl.load(source_ptr + source, mask=mask)
                x2 = tl.load(source_ptr + source + HALF, mask=mask)
                if part <= PER_GROUP:  # query and key heads: rotate in float32, round once
                    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
                    x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
                dtype = target_ptr.dtype.element_ty
                tl.store(target_ptr + target, x1.to(dtype), mask=mask)
                tl.store(target_ptr + target + HALF, x2.to(dtype), mask=mask)

        _SPLIT_KERNEL = triton.jit(rotate_split_grouped_qkv)
    return _SPLIT_KERNEL


def _heads_per_group(num_heads: int, num_groups: int | None) -> tuple[int, int]:
    """``(groups, query heads per group)``; ``num_groups`` None means one key/value head per query head."""
    groups = num_heads if num_groups is None else num_groups
    if groups < 1 or num_heads % groups:
        raise ValueError(f"{num_heads} query heads cannot be split into {groups} key/value groups")
    return groups, num_heads // groups


def _check_grouped(qkv, positions, num_heads: int, head_dim: int, num_groups: int | None) -> tuple[int, int]:
    """Refuse a QKV buffer or positions that do not fit the layout; returns ``(groups, query heads per group)``."""
    groups, per_group = _heads_per_group(num_heads, num_groups)
    width = groups * (per_group + 2) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or not qkv.is_contiguous():
        layout = f"3 * {num_heads}" if per_group == 1 else f"{groups} * ({per_group} + 2)"
        raise ValueError(
            f"expected a contiguous [tokens, {layout} * {head_dim}] QKV buffer, got "
            f"{tuple(qkv.shape)} (contiguous: {qkv.is_contiguous()})"
        )
    if positions.shape != (qkv.shape[0],):
        raise ValueError(f"positions {tuple(positions.shape)} must have one entry per token ({qkv.shape[0]})")
    return groups, per_group


def _rotate_(qkv, positions, cos, sin, num_heads: int, head_dim: int, num_groups: int | None, inverse: bool) -> None:
    """Rotate ``qkv``'s query and key channels in place (the value channels are not touched)."""
    tokens = qkv.shape[0]
    groups, per_group = _check_grouped(qkv, positions, num_heads, head_dim, num_groups)
    if tokens == 0:
        return
    _kernel()[(tokens,)](
        qkv,
        positions,
        cos,
        sin,
        qkv.stride(0),
        groups,
        (per_group + 2) * head_dim,
        HALF=head_dim // 2,
        BLOCK_GROUPS=triton.next_power_of_2(groups),
        ROTATED=per_group + 1,
        INVERSE=inverse,
    )


class _RotateQueryKeyInPlace(torch.autograd.Function):
    """The rotation written into the projection's own buffer, and in backward into the incoming gradient.

    Only the query and key heads are read and written: a copy of the buffer would also move the values. Safe where
    the hook uses it, and only there: TE's projection keeps no reference to its output for its backward (it saves its
    input and weight), and the gradient arriving here is the dQKV buffer that attention's backward wrote for this
    layer alone. The buffer is modified through ``detach()`` because TE returns its output as a view made inside its
    own autograd Function, which autograd does not let anyone modify in place by the book; this Function's backward
    supplies the gradient that such a modification would otherwise lose.
    """

    @staticmethod
    def forward(ctx, qkv, positions, cos, sin, num_heads: int, head_dim: int, num_groups: int | None):
        rotated = qkv.detach()
        _rotate_(rotated, positions, cos, sin, num_heads, head_dim, num_groups, inverse=False)
        ctx.save_for_backward(positions, cos, sin)
        ctx.shape = (num_heads, head_dim, num_groups)
        return rotated

    @staticmethod
    def backward(ctx, grad):
        positions, cos, sin = ctx.saved_tensors
        grad = grad.contiguous()  # a copy only if attention's dQKV came strided
        _rotate_(grad, positions, cos, sin, *ctx.shape, inverse=True)
        return grad, None, None, None, None, None, None


def rotate_query_key_(
    qkv, positions, cos, sin, num_heads: int, head_dim: int, num_groups: int | None = None
) -> torch.Tensor:
    """Rotate the query and key channels of ``qkv`` in place: token ``t`` by the angles in row ``positions[t]`` of
    ``cos`` / ``sin`` ([max_position, head_dim / 2], float32). ``qkv`` is [tokens, groups * (heads / groups + 2) *
    head_dim], every group laid out as its query heads, its key head, its value head (``num_groups`` None: one group
    per head, [query, key, value] each). Returns a differentiable tensor on ``qkv``'s memory; its backward rotates the
    incoming gradient in place (see ``_RotateQueryKeyInPlace`` for when that is safe: the QKV projection's output,
    consumed by attention alone)."""
    return _RotateQueryKeyInPlace.apply(qkv, positions, cos, sin, num_heads, head_dim, num_groups)


def _run_split_kernel(grouped, query, key, value, positions, cos, sin, groups, per_group, head_dim, to_grouped):
    if grouped.shape[0] == 0:
        return
    _split_kernel()[(grouped.shape[0],)](
        grouped,
        query,
        key,
        value,
        positions,
        cos,
        sin,
        grouped.stride(0),
        (per_group + 2) * head_dim,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        groups,
        HALF=head_dim // 2,
        BLOCK_GROUPS=triton.next_power_of_2(groups),
        PER_GROUP=per_group,
        TO_GROUPED=to_grouped,
    )


def _token_ranges(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive token ranges of the given sizes."""
    ends = [sum(sizes[: index + 1]) for index in range(len(sizes))]
    return list(zip([0, *ends[:-1]], ends))


class _RotateSplitGroupedQKV(torch.autograd.Function):
    """Grouped QKV projection -> rotated query, rotated key, value (three new contiguous tensors) for each of
    consecutive token ranges (``sizes``), and back: each range's gradients are written into its rows of the one
    grouped gradient by a launch of their own, so nothing concatenates them first."""

    @staticmethod
    def forward(ctx, qkv, positions, cos, sin, num_heads: int, head_dim: int, num_groups, sizes: tuple[int, ...]):
        groups, per_group = _check_grouped(qkv, positions, num_heads, head_dim, num_groups)
        outputs = []
        for start, end in _token_ranges(sizes):
            query = qkv.new_empty(end - start, num_heads, head_dim)
            key = qkv.new_empty(end - start, groups, head_dim)
            value = qkv.new_empty(end - start, groups, head_dim)
            rows = slice(start, end)
            _run_split_kernel(
                qkv[rows], query, key, value, positions[rows], cos, sin, groups, per_group, head_dim, False
            )
            outputs += [query, key, value]
        ctx.save_for_backward(positions, cos, sin)
        ctx.layout = (groups, per_group, head_dim, qkv.dtype, sizes)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        positions, cos, sin = ctx.saved_tensors
        groups, per_group, head_dim, dtype, sizes = ctx.layout
        grouped = positions.new_empty(sum(sizes), groups * (per_group + 2) * head_dim, dtype=dtype)
        for index, (start, end) in enumerate(_token_ranges(sizes)):
            rows, range_grads = slice(start, end), []
            for grad, heads in zip(grads[3 * index : 3 * index + 3], (groups * per_group, groups, groups)):
                if grad is None:  # an output that did not reach the loss
                    grad = grouped.new_zeros(end - start, heads, head_dim)
                range_grads.append(grad if grad.stride(-1) == 1 else grad.contiguous())  # any token and head strides
            _run_split_kernel(
                grouped[rows], *range_grads, positions[rows], cos, sin, groups, per_group, head_dim, True
            )
        return grouped, None, None, None, None, None, None, None


def rotate_split_qkv(
    qkv, positions, cos, sin, num_heads: int, head_dim: int, num_groups: int | None = None, sizes=None
) -> tuple[torch.Tensor, ...]:
    """Query [tokens, heads, head_dim] and key [tokens, groups, head_dim] rotated as ``rotate_query_key_`` rotates
    them, and value [tokens, groups, head_dim], as new contiguous tensors read from ``qkv`` (the grouped projection,
    which is not modified) in one pass; the backward writes their gradients into the grouped layout in one pass.

    ``sizes`` (token counts summing to the tokens): the three for each of these consecutive token ranges, in turn
    (query, key, value of the first range, then of the next), each range's tensors on their own; the backward then
    takes each range's gradients where its attention call left them. None: one range, all tokens."""
    sizes = (qkv.shape[0],) if sizes is None else tuple(int(size) for size in sizes)
    if sum(sizes) != qkv.shape[0] or min(sizes) < 0:
        raise ValueError(f"token ranges {list(sizes)} must be counts that add up to the {qkv.shape[0]} tokens")
    return _RotateSplitGroupedQKV.apply(qkv, positions, cos, sin, num_heads, head_dim, num_groups, sizes)


def rotate_query_key_reference(
    qkv, positions, cos, sin, num_heads: int, head_dim: int, num_groups: int | None = None
) -> torch.Tensor:
    """The same rotation in plain torch (tests compare the kernel with it)."""
    groups, per_group = _heads_per_group(num_heads, num_groups)
    heads = qkv.view(qkv.shape[0], groups, per_group + 2, head_dim).float()
    c, s = cos[positions][:, None, None, :], sin[positions][:, None, None, :]
    half = head_dim // 2
    x1, x2 = heads[:, :, : per_group + 1, :half], heads[:, :, : per_group + 1, half:]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    out = torch.cat([rotated, heads[:, :, per_group + 1 :]], dim=2)
    return out.to(qkv.dtype).reshape(qkv.shape)


class PackedQKVRotary:
    """Rotary embeddings for a stack of TE layers, applied by forward hooks on their QKV projections.

    ``attach(layers)`` once; then, before each pass over the layers, ``set_batch(positions, freqs)`` with every
    token's position in its sequence and the rotary table ([max_seqlen, 1, 1, head_dim], half-split, as given to
    TE) and call the layers with ``rotary_pos_emb=None``; ``set_batch(None)`` leaves the projections untouched (the
    caller passes ``rotary_pos_emb`` as usual). The batch stays set until the next call, so that activation
    recomputation in the backward rotates the same way.
    """

    def __init__(self, num_heads: int, head_dim: int, num_groups: int | None = None):
        _heads_per_group(num_heads, num_groups)  # refuse a grouping that does not divide the heads now
        self.num_heads, self.head_dim, self.num_groups = num_heads, head_dim, num_groups
        self._batch = None

    @classmethod
    def for_layers(
        cls, layers, num_heads: int, head_dim: int, required_by: str | None = None, num_groups: int | None = None
    ) -> "PackedQKVRotary | None":
        """Attached to ``layers`` where this machine and head size allow it (Triton importable, head_dim / 2 a
        power of two); None otherwise: the caller then keeps TE's RoPE. ``required_by`` names a setting that has no
        such fallback (its layers apply no rotary table themselves): then a ValueError instead of None.
        ``num_groups``: key/value heads under grouped-query attention (None: as many as query heads)."""
        if not (available() and supports(head_dim)):
            if required_by is not None:
                raise ValueError(
                    f"{required_by} rotates queries and keys inside the QKV projection, which needs Triton and half "
                    f"a head ({head_dim // 2}) to be a power of two"
                )
            return None
        rotary = cls(num_heads, head_dim, num_groups)
        rotary.attach(layers)
        return rotary

    def attach(self, layers) -> None:
        grouped = self.num_groups is not None and self.num_groups < self.num_heads
        for layer in layers:
            attention = layer.self_attention
            if grouped and hasattr(attention, "qkv_rotary"):
                # A layer that splits the projection itself (FusedResidualTransformerLayer under GQA) rotates while
                # it splits: rotate_and_split, one pass, instead of rotating here and copying there.
                attention.qkv_rotary = self
            else:
                attention.layernorm_qkv.register_forward_hook(self._rotate_projection)

    def set_batch(self, positions: torch.Tensor | None, freqs: torch.Tensor | None = None) -> None:
        if positions is None:
            self._batch = None
            return
        angles = freqs.reshape(freqs.shape[0], -1)[:, : self.head_dim // 2].float()
        self._batch = (positions, torch.cos(angles).contiguous(), torch.sin(angles).contiguous())

    def rotate_and_split(self, qkv: torch.Tensor, sizes=None):
        """``rotate_split_qkv`` (over the token ranges ``sizes``) with this batch's positions; None while no batch is
        set (the caller then splits the projection unrotated, as the hook would leave it)."""
        if self._batch is None:
            return None
        return rotate_split_qkv(qkv, *self._batch, self.num_heads, self.head_dim, self.num_groups, sizes)

    def _rotate_projection(self, module, args, output):
        if self._batch is None:
            return output
        qkv, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
        if type(qkv) is not torch.Tensor:
            raise TypeError(f"in-place RoPE needs a plain tensor QKV projection, got {type(qkv).__name__}")
        qkv = rotate_query_key_(qkv, *self._batch, self.num_heads, self.head_dim, self.num_groups)
        return qkv if rest is None else (qkv, *rest)


def layers_rotary_pos_emb(
    qkv_rotary: PackedQKVRotary | None, packed, table: torch.Tensor, fused_qkv_rope: bool, fused_residual_norm: bool
) -> torch.Tensor | None:
    """Prepare one pass of a model's layers over ``packed`` (a packing.PackedBatch) and return the
    ``rotary_pos_emb`` to call them with: None where the QKV projections rotate queries and keys themselves, else
    ``table`` (TE's RoPE in the layers).

    The projections rotate when the model has a ``qkv_rotary`` and either its config asks for it
    (``fused_qkv_rope``) and the pass allows it, or its layers cannot do otherwise (``fused_residual_norm``: then a
    pass that does not allow it is an error). A pass does not allow it under context parallelism (per-sequence
    padding: TE's RoPE places each rank's shares) or under torch.compile (dynamo fails inside TE's attention on the
    packed-QKV path; TE 2.20, torch 2.11).
    """
    if qkv_rotary is None:
        return table
    allowed = packed.cu_seqlens_padded is None and not torch.compiler.is_compiling()
    if fused_residual_norm and not allowed:
        raise ValueError(
            "fused_residual_norm layers take packed sequences without per-sequence padding (no context "
            "parallelism) and do not run under torch.compile; set fused_residual_norm=False for those"
        )
    in_projection = allowed and (fused_qkv_rope or fused_residual_norm)
    qkv_rotary.set_batch(packed.positions() if in_projection else None, table)
    return None if in_projection else table
