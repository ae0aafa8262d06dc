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

``PackedCuDNNAttention`` is ``te.DotProductAttention`` (same arguments, same state-dict keys) for layers whose
attention call is host-bound: where TE runs cuDNN's attention on packed (THD) 16-bit input, it calls TE's
``fused_attn_fwd``/``fused_attn_bwd`` itself, without the per-call Python of ``DotProductAttention.forward`` (argument
checks, backend selection, layout detection): 0.4-0.7 ms less host time per layer forward on one H200, where an
AMPLIFY 350M layer at 32k tokens keeps the GPU busy ~5 ms forward and backward. That pays where the host cannot keep
ahead of the GPU (AMPLIFY 120M training +3-20% per run pair on H200s), not where it can (AMPLIFY 350M, ESM-2 650M:
unchanged); docs/benchmarks.md. It lets TE decide first: the first call with a given layout, dtype, mask, head
shape and FP8 state runs TE's own path, and only if TE chose cuDNN's F16_arbitrary_seqlen backend do later calls
with that signature go direct, with the arguments TE passes (softmax scale, no dropout, ``padded`` boundaries = the
boundaries, the window of the mask type, TE's deterministic setting). Under FP8 autocast attention itself stays in
16 bits unless the recipe asks for FP8 attention (``fp8_dpa``/``fp8_mha``), so only such recipes keep TE's path.
Context parallelism, dropout, other formats, and any argument not at the value that asks for nothing more
(``NEUTRAL_ARGUMENTS``: what TE's ``MultiheadAttention`` passes on every call) take TE's path every time.
Where the sequences lie end to end (no padded boundaries of their own), the direct backward also skips TE's zero
fill of dQ, dK and dV (te_attention_backward.py: TE's C entry point on unfilled buffers, zeroing only the rows after
the last sequence), where TE 2.20 allows it; elsewhere it calls TE's ``fused_attn_bwd``.

``call_cudnn_directly(layers)`` turns the ``DotProductAttention`` inside TE's own ``TransformerLayer`` into this class
(it adds behaviour only: no parameters, buffers or state-dict keys), for the runs that use TE's layers rather than
the fused ones: FP8 runs, whose forward is host-bound at ESM-2 3B (docs/benchmarks.md).
"""

import inspect
import os

import torch


try:  # package import (models/*, exported checkpoints)
    from .te_attention_backward import available as _backward_without_fill_available
    from .te_attention_backward import backward_without_fill
except ImportError:  # flat copy inside a recipe folder
    from te_attention_backward import available as _backward_without_fill_available
    from te_attention_backward import backward_without_fill

try:
    import transformer_engine.pytorch as te
except Exception:  # no TE (CPU), or a broken CUDA install raising at import: PackedCuDNNAttention is not offered
    te = None
try:  # TE's internals the direct calls need; a TE without them gets PackedCuDNNAttention taking TE's path always
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as _te_dpa
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend, fused_attn_bwd, fused_attn_fwd

    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE releases before the quantization module
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
except Exception:
    _te_dpa = None


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


# --------------------------------------------------------------------------- cuDNN attention without TE's Python


def packed_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """TE's name for how [tokens, heads, head_dim] query, key and value lie in memory, for the two layouts this
    project hands attention: "th3d" (views of one [tokens, heads, 3, head_dim] buffer, as ``SplitPackedQKV`` gives)
    and "thd_thd_thd" (three contiguous tensors). None for anything else (TE's own path works it out)."""
    if not (query.dim() == key.dim() == value.dim() == 3):
        return None
    if all(t.is_contiguous() for t in (query, key, value)):
        return "thd_thd_thd"
    head_dim = query.shape[-1]
    same_buffer = query.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()
    same_buffer = same_buffer and key.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    if (
        same_buffer
        and query.shape == key.shape == value.shape
        and query.stride() == key.stride() == value.stride() == (3 * head_dim * query.shape[1], 3 * head_dim, 1)
        and key.storage_offset() == query.storage_offset() + head_dim
        and value.storage_offset() == query.storage_offset() + 2 * head_dim
    ):
        return "th3d"
    return None


def _at_buffer_start(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q/k/v as TE's layout detection (2.20) takes them: it refuses tensors that do not start their buffer (unless they
    lie in the query's buffer, packed as TE packs them), such as the packed sequences that follow the full windows
    ``FusedResidualTransformerLayer`` splits off. Such q/k/v are copied for TE's path; the direct calls take views."""
    if any(type(t) is not torch.Tensor for t in (query, key, value)):  # FP8 tensors: TE's business
        return query, key, value
    buffer = query.untyped_storage().data_ptr()
    off_start = query.storage_offset() != 0 or any(
        t.storage_offset() != 0 and t.untyped_storage().data_ptr() != buffer for t in (key, value)
    )
    return tuple(t.clone() for t in (query, key, value)) if off_start else (query, key, value)


def _parameters(function) -> tuple[set[str], set[str]]:
    """(every parameter name, the required ones) of one of TE's functions."""
    parameters = inspect.signature(function).parameters
    required = {n for n, p in parameters.items() if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD}
    return set(parameters), required


def _keep(accepted: set[str], **arguments):
    """The arguments a TE function of this release takes (older ones lack e.g. ``o_format``, which they infer)."""
    return {name: value for name, value in arguments.items() if name in accepted}


def _full_window(value, mask_type: str) -> bool:
    return value is None or tuple(value) == ((-1, 0) if "causal" in mask_type else (-1, -1))


# Arguments TE's MultiheadAttention passes to its attention on every call (TE 2.20), each with a test that its value
# asks for nothing the direct calls do not do: no sliding window, no softcap, no bias, no recompute inside attention,
# no FP8 output, no KV cache, no packed input left unsplit (split_packed_qkv's hook has taken it apart).
NEUTRAL_ARGUMENTS = {
    "window_size": _full_window,
    "bottom_right_diagonal": lambda value, mask_type: not value or "causal" not in mask_type,
    "softcap": lambda value, _: not value,
    "thd_attention_policies": lambda value, _: value is None,
    "thd_attention_policy_dispatch": lambda value, _: value == "auto",
    "checkpoint_core_attention": lambda value, _: value is False,
    "core_attention_bias_type": lambda value, _: value == "no_bias",
    "core_attention_bias": lambda value, _: value is None,
    "alibi_slopes": lambda value, _: value is None,
    "fast_zero_fill": lambda value, _: value is True,
    "inference_params": lambda value, _: value is None,
    "pad_between_seqs": lambda value, _: value is None,  # TE infers it from the padded boundaries, as passed on
    "fp8_output": lambda value, _: not value,
    "qkv_layer": lambda value, _: value is None,
    "kv_layer": lambda value, _: value is None,
    "qkv_interleave_dim": lambda value, _: True,  # only read with qkv_layer
}


def neutral_arguments(arguments: dict, mask_type: str) -> bool:
    """Whether every one of ``arguments`` (beyond the packed call's) is one of TE's that asks for nothing here."""
    return all(
        name in NEUTRAL_ARGUMENTS and NEUTRAL_ARGUMENTS[name](value, mask_type) for name, value in arguments.items()
    )


# What _CuDNNAttention passes; a TE release whose functions require anything else is not called directly.
_FWD_ARGUMENTS = {
    "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "fake_dtype",
    "fused_attention_backend", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "attn_scale", "dropout",
    "fast_zero_fill", "qkv_layout", "o_format", "attn_bias_type", "attn_mask_type", "window_size",
}  # fmt: skip
_BWD_ARGUMENTS = (_FWD_ARGUMENTS - {"is_training"}) | {
    "o", "d_o", "aux_ctx_tensors", "do_format", "dqkv_layout", "deterministic",
}  # fmt: skip


class _CuDNNAttention(torch.autograd.Function):
    """TE's cuDNN attention kernels (``fused_attn_fwd``/``fused_attn_bwd``) on packed q/k/v and their sequence
    boundaries (actual and padded); ``settings``: max lengths, training, scale, layout, mask, window, determinism."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens_q, cu_seqlens_kv, cu_padded_q, cu_padded_kv, settings):
        out, aux = fused_attn_fwd(
            **_keep(
                _FWD_PARAMETERS,
                is_training=settings["training"],
                max_seqlen_q=settings["max_seqlen_q"],
                max_seqlen_kv=settings["max_seqlen_kv"],
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
                q=query,
                k=key,
                v=value,
                fake_dtype=query.dtype,
                fused_attention_backend=FusedAttnBackend["F16_arbitrary_seqlen"],
                cu_seqlens_q_padded=cu_padded_q,
                cu_seqlens_kv_padded=cu_padded_kv,
                attn_scale=settings["scale"],
                dropout=0.0,
                fast_zero_fill=True,
                qkv_layout=settings["layout"],
                o_format="thd",
                attn_bias_type="no_bias",
                attn_mask_type=settings["mask_type"],
                window_size=settings["window"],
            )
        )[:2]
        ctx.save_for_backward(query, key, value, out, cu_seqlens_q, cu_seqlens_kv, cu_padded_q, cu_padded_kv, *aux)
        ctx.settings = settings
        # The padded boundaries are the boundaries themselves (no padding between sequences): the backward can skip
        # TE's zero fill of dQ, dK and dV (te_attention_backward.py).
        ctx.unpadded = cu_padded_q is cu_seqlens_q and cu_padded_kv is cu_seqlens_kv
        return out.view(*out.shape[:-2], -1)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, cu_seqlens_q, cu_seqlens_kv, cu_padded_q, cu_padded_kv, *aux = ctx.saved_tensors
        settings = ctx.settings
        if ctx.unpadded and _backward_without_fill_available():
            d_query, d_key, d_value = backward_without_fill(
                query, key, value, out, grad.view(out.shape).contiguous(), aux, cu_seqlens_q, cu_seqlens_kv, settings
            )
            return d_query, d_key, d_value, None, None, None, None, None
        d_query, d_key, d_value, *_ = fused_attn_bwd(
            **_keep(
                _BWD_PARAMETERS,
                max_seqlen_q=settings["max_seqlen_q"],
                max_seqlen_kv=settings["max_seqlen_kv"],
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
                q=query,
                k=key,
                v=value,
                o=out,
                d_o=grad.view(out.shape).contiguous(),
                fake_dtype=query.dtype,
                aux_ctx_tensors=aux,
                fused_attention_backend=FusedAttnBackend["F16_arbitrary_seqlen"],
                cu_seqlens_q_padded=cu_padded_q,
                cu_seqlens_kv_padded=cu_padded_kv,
                attn_scale=settings["scale"],
                dropout=0.0,
                fast_zero_fill=True,
                qkv_layout=settings["layout"],
                o_format="thd",
                do_format="thd",
                dqkv_layout=settings["layout"],
                attn_bias_type="no_bias",
                attn_mask_type=settings["mask_type"],
                window_size=settings["window"],
                deterministic=settings["deterministic"],
            )
        )
        return d_query, d_key, d_value, None, None, None, None, None


_DIRECT_CALL_POSSIBLE = False
if _te_dpa is not None:
    (_FWD_PARAMETERS, _fwd_required), (_BWD_PARAMETERS, _bwd_required) = map(
        _parameters, (fused_attn_fwd, fused_attn_bwd)
    )
    _DIRECT_CALL_POSSIBLE = _fwd_required <= _FWD_ARGUMENTS and _bwd_required <= _BWD_ARGUMENTS

if te is not None:

    def _te_chose_cudnn() -> bool:
        """Whether TE's last ``DotProductAttention`` call ran cuDNN's F16_arbitrary_seqlen kernels (its own record)."""
        chosen = getattr(_te_dpa, "_attention_backends", None) or {}
        return bool(
            chosen.get("use_fused_attention")
            and not chosen.get("use_flash_attention")
            and chosen.get("fused_attention_backend") == FusedAttnBackend["F16_arbitrary_seqlen"]
        )

    class PackedCuDNNAttention(te.DotProductAttention):
        """``te.DotProductAttention`` that calls cuDNN's attention directly for packed 16-bit input once TE has
        chosen it for that signature (see the module docstring); every other call is TE's."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._cudnn_chosen: dict[tuple, bool] = {}  # signature -> TE chose cuDNN's F16_arbitrary_seqlen kernels
            # False: q/k/v may be views that TE's path refuses (the fused layers' split batches; _at_buffer_start).
            # True (take_over): q/k/v come from TE's own MultiheadAttention, and TE's path takes them as they are.
            self._inputs_from_te_layer = False

        def forward(  # te.DotProductAttention's parameters, in its order
            self,
            query_layer: torch.Tensor,
            key_layer: torch.Tensor,
            value_layer: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            qkv_format: str | None = None,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_kv: torch.Tensor | None = None,
            cu_seqlens_q_padded: torch.Tensor | None = None,
            cu_seqlens_kv_padded: torch.Tensor | None = None,
            max_seqlen_q: int | None = None,
            max_seqlen_kv: int | None = None,
            attn_mask_type: str | None = None,
            *more,
            **others,
        ) -> torch.Tensor:
            arguments = {
                "attention_mask": attention_mask,
                "qkv_format": qkv_format,
                "cu_seqlens_q": cu_seqlens_q,
                "cu_seqlens_kv": cu_seqlens_kv,
                "cu_seqlens_q_padded": cu_seqlens_q_padded,
                "cu_seqlens_kv_padded": cu_seqlens_kv_padded,
                "max_seqlen_q": max_seqlen_q,
                "max_seqlen_kv": max_seqlen_kv,
                "attn_mask_type": attn_mask_type,
            }
            mask_type = attn_mask_type or self.attn_mask_type
            signature = self._signature(query_layer, key_layer, value_layer, mask_type, arguments, more, others)
            chosen = self._cudnn_chosen.get(signature) if signature is not None else False
            if not chosen:
                if not self._inputs_from_te_layer:
                    query_layer, key_layer, value_layer = _at_buffer_start(query_layer, key_layer, value_layer)
                out = super().forward(query_layer, key_layer, value_layer, *arguments.values(), *more, **others)
                if chosen is None:  # the first call with this signature: remember what TE chose
                    self._cudnn_chosen[signature] = _te_chose_cudnn()
                return out
            settings = {
                "training": self.training,
                "max_seqlen_q": max_seqlen_q,
                "max_seqlen_kv": max_seqlen_kv if max_seqlen_kv is not None else max_seqlen_q,
                "scale": self.softmax_scale,
                "layout": signature[0],
                "mask_type": mask_type,
                "window": (-1, 0) if "causal" in mask_type else (-1, -1),
                "deterministic": getattr(self, "deterministic", False),
            }
            cu_seqlens_kv = cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q
            return _CuDNNAttention.apply(
                query_layer,
                key_layer,
                value_layer,
                cu_seqlens_q,
                cu_seqlens_kv,
                cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q,
                cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv,
                settings,
            )

        def _signature(self, query, key, value, mask_type, arguments, more, others) -> tuple | None:
            """What TE's backend choice depends on here, or None where this call must take TE's path."""
            if (
                torch.compiler.is_compiling()  # first: nothing else is traced under torch.compile
                or not _DIRECT_CALL_POSSIBLE
                or more
                or not neutral_arguments(others, mask_type)
                or self.window_size not in (None, (-1, -1), (-1, 0))  # the constructor's sliding window
                or getattr(self, "softcap", 0.0)
                or (self.training and self.attention_dropout > 0)
                or arguments["attention_mask"] is not None
                or (arguments["qkv_format"] or self.qkv_format) != "thd"
                or arguments["cu_seqlens_q"] is None
                or arguments["max_seqlen_q"] is None
                or mask_type not in ("padding", "padding_causal")
                or any(type(t) is not torch.Tensor for t in (query, key, value))  # FP8 tensors: TE's path
                or query.dtype not in (torch.bfloat16, torch.float16)
                or not query.dtype == key.dtype == value.dtype
                or _attention_in_fp8()
                or getattr(self, "cp_group", None) is not None
                or os.getenv("NVTE_FUSED_ATTN_USE_FAv2_BWD", "0") == "1"  # noqa: SIM112 (TE's spelling)
            ):
                return None
            layout = packed_layout(query, key, value)
            if layout is None:
                return None
            fp8 = FP8GlobalStateManager.is_fp8_enabled()  # TE's choice is remembered per FP8 state
            return (layout, query.dtype, mask_type, query.shape[1:], key.shape[1:], query.device, fp8)

        @classmethod
        def take_over(cls, attention: "te.DotProductAttention") -> None:
            """Make TE's ``attention`` (built inside TE's ``TransformerLayer``) one of these, in place. Every call the
            direct path does not take reaches ``te.DotProductAttention.forward`` with its arguments untouched."""
            attention.__class__ = cls
            attention._cudnn_chosen = {}
            attention._inputs_from_te_layer = True

    def _attention_in_fp8() -> bool:
        """Whether TE runs attention itself in FP8 here: under FP8 autocast with a recipe that asks for FP8 attention
        (``fp8_dpa``/``fp8_mha``; a recipe without those settings counts as asking)."""
        if not FP8GlobalStateManager.is_fp8_enabled():
            return False
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        return getattr(recipe, "fp8_dpa", True) or getattr(recipe, "fp8_mha", True)

    def call_cudnn_directly(layers) -> int:
        """Turn every ``te.DotProductAttention`` in ``layers`` (TE's ``TransformerLayer``s) into a
        ``PackedCuDNNAttention``; returns how many. Call it after ``split_packed_qkv``, whose hooks stay attached."""
        taken = 0
        for layer in layers:
            for module in layer.modules():
                if type(module) is te.DotProductAttention:
                    PackedCuDNNAttention.take_over(module)
                    taken += 1
        return taken

else:
    PackedCuDNNAttention = None  # needs TE

    def call_cudnn_directly(layers) -> int:
        raise RuntimeError("call_cudnn_directly needs TransformerEngine")
