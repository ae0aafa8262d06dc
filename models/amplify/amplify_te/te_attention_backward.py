# Copied from common/te_attention_backward.py — edit the source, then run ci/check_copies.py --fix
"""cuDNN's attention backward for packed (THD) 16-bit input, through TE's C API, without TE's zero fill.

TE's ``fused_attn_bwd`` (its C++ extension, 2.20) allocates dQ, dK and dV and, for THD input in 16 bits, fills all
three with zeros before cuDNN writes them: three strided ``fill_`` passes per layer over [tokens, 3 * hidden]. cuDNN
writes every row that belongs to a sequence, so where the sequences are laid end to end (no padding between them:
the padded boundaries are the boundaries) the fill only matters for the rows after the last sequence (alignment
padding that ``packing.pack_inputs`` appends). On ESM-2 650M at 49,152 tokens the fills took ~8 ms of a ~423 ms
step on one H200 (docs/benchmarks.md).

``backward_without_fill`` calls the same entry point TE's extension calls, ``nvte_fused_attn_bwd`` in
``libtransformer_engine.so``, with the same arguments, on output buffers it allocates itself without filling them, and
then zeroes only the rows from the last sequence's end on (one small kernel that reads that end on the GPU: no host
sync). The kernels cuDNN runs are TE's; dQ, dK and dV are bit for bit what TE's path gives (GPU test).

The C signature, the struct layouts and the dtype codes below are TE 2.20's (``transformer_engine.h``,
``fused_attn.h``); the enum values come from TE's own Python bindings. ``available()`` is True only for TE 2.20.x
with the symbols present; every other release keeps TE's ``fused_attn_bwd`` (with its fill). TE's extension turns an
error raised inside its C library into a Python exception; called through ctypes such an error ends the process.
The direct path only reaches this for a signature whose first call TE itself ran with these kernels (te_attention.py).
"""

import ctypes

import torch


try:
    import transformer_engine
    import transformer_engine.common as _te_common
    from transformer_engine.pytorch.cpp_extensions.fused_attn import (
        AttnBiasType,
        AttnMaskType,
        QKVFormat,
        QKVLayout,
        SoftmaxType,
    )
except Exception:  # no TE (CPU), or a broken CUDA install raising at import
    transformer_engine = None
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

SUPPORTED_TE_RELEASE = "2.20."  # the release whose C API this file is written against

# transformer_engine.h (2.20): NVTEDType codes, NVTETensorParam kNVTERowwiseData, NVTE_DELAYED_TENSOR_SCALING
# (the plain, unscaled tensor), and the structs passed by pointer or value.
_DTYPE_CODES = {
    torch.uint8: 0,
    torch.int32: 2,
    torch.int64: 3,
    torch.float32: 4,
    torch.float16: 5,
    torch.bfloat16: 6,
}
_ROWWISE_DATA = 0
_PLAIN_TENSOR = 0


class _Shape(ctypes.Structure):
    _fields_ = [("data", ctypes.c_size_t * 15), ("ndim", ctypes.c_size_t)]


class _BasicTensor(ctypes.Structure):
    _fields_ = [("data_ptr", ctypes.c_void_p), ("dtype", ctypes.c_int), ("shape", _Shape)]


class _TensorPack(ctypes.Structure):
    _fields_ = [("tensors", ctypes.c_void_p * 10), ("size", ctypes.c_size_t)]


_c_void_p, _c_int, _c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_BWD_ARGTYPES = (
    [_c_void_p] * 7  # Q, K, V, O, dO, S, dP
    + [ctypes.POINTER(_TensorPack)]  # Aux_CTX_Tensors
    + [_c_void_p] * 5  # dQ, dK, dV, dBias, dSoftmaxOffset
    + [_c_void_p] * 4  # cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    + [_c_size_t, _c_size_t, ctypes.c_float, ctypes.c_float]  # max_seqlen_q, max_seqlen_kv, attn_scale, dropout
    # qkv_layout, o_format, do_format, dqkv_layout, qkv_scale_inv_format, do_scale_inv_format, bias_type,
    # attn_mask_type, softmax_type
    + [_c_int] * 9
    + [ctypes.c_int64, ctypes.c_int64]  # window_size_left, window_size_right
    + [ctypes.c_bool] * 3  # bottom_right_diagonal, deterministic, cuda_graph
    + [_c_void_p, _c_void_p]  # workspace, stream
)

_LIBRARY = None


def _library():
    """TE's core library with the signatures used here declared, or None where this file does not apply."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = False
        if transformer_engine is not None and transformer_engine.__version__.startswith(SUPPORTED_TE_RELEASE):
            try:
                # The library TE loaded (dlopen hands back the same handle), in a CDLL object of our own so that the
                # signatures declared here do not touch TE's.
                library = ctypes.CDLL(str(_te_common._get_shared_object_file("core")), mode=ctypes.RTLD_GLOBAL)
                signatures = {
                    "nvte_create_tensor": ([_c_int], _c_void_p),
                    "nvte_destroy_tensor": ([_c_void_p], None),
                    "nvte_set_tensor_param_v2": ([_c_void_p, _c_int, _c_void_p, _c_size_t], None),
                    "nvte_tensor_shape": ([_c_void_p], _Shape),
                    "nvte_tensor_pack_create": ([ctypes.POINTER(_TensorPack)], None),
                    "nvte_tensor_pack_destroy": ([ctypes.POINTER(_TensorPack)], None),
                    "nvte_fused_attn_bwd": (_BWD_ARGTYPES, None),
                }
                for name, (argtypes, restype) in signatures.items():
                    function = getattr(library, name)
                    function.argtypes, function.restype = argtypes, restype
                _LIBRARY = library
            except (AttributeError, OSError):  # a build without these symbols
                _LIBRARY = False
    return _LIBRARY or None


def available() -> bool:
    """Whether ``backward_without_fill`` can run here (TE 2.20.x with its C API, Triton for the tail kernel)."""
    return triton is not None and _library() is not None


def _basic(tensor: torch.Tensor | None) -> _BasicTensor:
    """The description of ``tensor`` (data pointer, dtype, shape) that TE's tensors hold; an empty one for None."""
    basic = _BasicTensor()
    if tensor is None:
        basic.dtype, basic.shape.ndim = _DTYPE_CODES[torch.float32], 1  # TE's empty tensor: shape [0], no data
        return basic
    basic.data_ptr, basic.dtype, basic.shape.ndim = tensor.data_ptr(), _DTYPE_CODES[tensor.dtype], tensor.dim()
    for index, size in enumerate(tensor.shape):
        basic.shape.data[index] = size
    return basic


def _set_data(library, handle: int, tensor: torch.Tensor | None) -> None:
    """Point TE tensor ``handle`` at ``tensor``'s memory (TE's row-wise data; nothing is copied)."""
    basic = _basic(tensor)
    library.nvte_set_tensor_param_v2(handle, _ROWWISE_DATA, ctypes.byref(basic), ctypes.sizeof(basic))


class _Tensors:
    """TE tensors (``NVTETensor`` handles) wrapping torch tensors for one call; destroyed on exit."""

    def __init__(self, library):
        self.library, self.handles = library, []

    def __call__(self, tensor: torch.Tensor | None) -> int:
        handle = self.library.nvte_create_tensor(_PLAIN_TENSOR)
        self.handles.append(handle)
        _set_data(self.library, handle, tensor)
        return handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            self.library.nvte_destroy_tensor(handle)


def empty_gradients(query, key, value, layout: str) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Unfilled buffers for dQ, dK, dV laid out as query, key and value are, and dQ, dK, dV in them: views of one
    [tokens, heads, 3, head_dim] buffer ("th3d"), or three contiguous tensors ("thd_thd_thd")."""
    if layout == "th3d":
        buffer = torch.empty((*query.shape[:-1], 3, query.shape[-1]), dtype=query.dtype, device=query.device)
        return [buffer], (buffer[..., 0, :], buffer[..., 1, :], buffer[..., 2, :])
    if layout == "thd_thd_thd":
        gradients = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
        return list(gradients), gradients
    raise ValueError(f"backward_without_fill takes the layouts 'th3d' and 'thd_thd_thd', not {layout!r}")


def backward_without_fill(
    query, key, value, out, grad_out, aux, cu_seqlens_q, cu_seqlens_kv, settings: dict, buffers=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of cuDNN's packed attention (``_CuDNNAttention``'s forward: no padding between sequences, no
    dropout, no bias, vanilla softmax). ``aux``: what TE's ``fused_attn_fwd`` returned beside the output (softmax
    statistics, RNG state); ``settings``: max lengths, scale, layout, mask type, window, determinism. ``buffers``
    (tests): ``empty_gradients``' output to write into instead of new buffers."""
    library = _library()
    buffers, (dq, dk, dv) = buffers or empty_gradients(query, key, value, settings["layout"])
    layout, mask = int(QKVLayout[settings["layout"]]), int(AttnMaskType[settings["mask_type"]])
    thd = int(QKVFormat["thd"])
    stream = ctypes.c_void_p(torch.cuda.current_stream(query.device).cuda_stream)
    pack = _TensorPack()
    library.nvte_tensor_pack_create(ctypes.byref(pack))
    try:
        with _Tensors(library) as wrap:
            for index, tensor in enumerate(aux):  # the pack's tensors are TE's own handles, created with it
                _set_data(library, pack.tensors[index], tensor)
            pack.size = len(aux)
            arguments = [
                *(wrap(t) for t in (query, key, value, out, grad_out, None, None)),  # ..., S, dP (unused in 16 bits)
                ctypes.byref(pack),
                *(wrap(t) for t in (dq, dk, dv, None, None)),  # ..., dBias, dSoftmaxOffset
                # no padding between sequences: the padded boundaries are the boundaries
                *(wrap(t) for t in (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q, cu_seqlens_kv)),
                settings["max_seqlen_q"],
                settings["max_seqlen_kv"],
                settings["scale"],
                0.0,  # dropout
                layout,
                thd,  # o_format
                thd,  # do_format
                layout,  # dqkv_layout
                int(QKVFormat[None]),  # qkv_scale_inv_format, do_scale_inv_format: not set (16 bits)
                int(QKVFormat[None]),
                int(AttnBiasType["no_bias"]),
                mask,
                int(SoftmaxType["vanilla"]),
                *settings["window"],
                False,  # bottom_right_diagonal (TE's default for the padding and padding_causal masks)
                settings["deterministic"],
                False,  # cuda_graph
            ]
            # As TE's extension does: a first call with an empty workspace asks for its size, the second runs.
            workspace = wrap(None)
            library.nvte_fused_attn_bwd(*arguments, workspace, stream)
            shape = library.nvte_tensor_shape(workspace)
            size = 1
            for dim in range(shape.ndim):
                size *= shape.data[dim]
            workspace_buffer = torch.empty(size, dtype=torch.uint8, device=query.device)
            library.nvte_fused_attn_bwd(*arguments, wrap(workspace_buffer), stream)
    finally:
        library.nvte_tensor_pack_destroy(ctypes.byref(pack))
    # Rows after the last sequence: one buffer of [tokens, heads, 3, head_dim] (self-attention: one set of
    # boundaries), or dQ with the query's boundaries and dK, dV with the keys'.
    for buffer, boundaries in zip(buffers, (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_kv)):
        zero_rows_after_last_sequence(buffer, boundaries)
    return dq, dk, dv


def zero_rows_after_last_sequence(tensor: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Zero rows ``cu_seqlens[-1]:`` of a contiguous ``tensor`` ([tokens, ...]), reading ``cu_seqlens[-1]`` where it
    lies (on the GPU: no host sync); blocks of rows before it return at once."""
    if not tensor.is_contiguous():
        raise ValueError("zero_rows_after_last_sequence takes a contiguous tensor")
    rows = tensor.shape[0]
    width = tensor.numel() // rows if rows else 0
    if width:
        block_rows, block_width = 16, min(1024, triton.next_power_of_2(width))
        _tail_kernel()[(triton.cdiv(rows, block_rows),)](
            tensor, cu_seqlens[-1:], rows, width, BLOCK_ROWS=block_rows, BLOCK_WIDTH=block_width
        )


_TAIL_KERNEL = None


def _tail_kernel():
    """The Triton kernel, JIT-decorated on first use (so that ``TRITON_INTERPRET`` set by a test is honoured; zeros
    come from ``tl.full``, which the interpreter can call either way)."""
    global _TAIL_KERNEL
    if _TAIL_KERNEL is None:

        def zero_tail(out_ptr, end_ptr, rows, width, BLOCK_ROWS: tl.constexpr, BLOCK_WIDTH: tl.constexpr):
            first_row = tl.program_id(0) * BLOCK_ROWS
            end = tl.load(end_ptr).to(tl.int64)
            if first_row + BLOCK_ROWS > end:
                row = first_row + tl.arange(0, BLOCK_ROWS).to(tl.int64)
                keep = (row >= end) & (row < rows)
                zeros = tl.full((BLOCK_ROWS, BLOCK_WIDTH), 0, out_ptr.dtype.element_ty)
                for start in range(0, width, BLOCK_WIDTH):
                    column = start + tl.arange(0, BLOCK_WIDTH)
                    mask = keep[:, None] & (column < width)[None, :]
                    tl.store(out_ptr + row[:, None] * width + column[None, :], zeros, mask=mask)

        _TAIL_KERNEL = triton.jit(zero_tail)
    return _TAIL_KERNEL
