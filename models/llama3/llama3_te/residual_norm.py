# Copied from common/residual_norm.py — edit the source, then run ci/check_copies.py --fix
"""RMSNorm and LayerNorm with the pre-norm residual connection folded into their kernels (Triton), both directions.

A pre-norm transformer layer computes ``h = x + attention(norm_1(x))`` and ``out = h + mlp(norm_2(h))``. Built from
TE's ``TransformerLayer``, every residual costs a separate elementwise kernel each way: the forward add ``x + a``
(two reads, one write over [tokens, hidden]) and, in backward, the sum of the two gradients that reach ``x`` (through
the norm and through the residual path). Here both live inside the norm kernels:

* ``rms_norm_keep_input(x, weight, eps) -> (y, x)`` (``layer_norm_keep_input(x, weight, bias, eps)``): the norm, and
  ``x`` itself as a second output meant for the residual path. Its backward receives both gradients and writes
  ``dx = norm_backward(dy) + d_residual`` in the same pass over the rows that computes the norm's gradient.
* ``add_rms_norm(a, residual, weight, eps) -> (y, h)`` (``add_layer_norm(a, residual, weight, bias, eps)``):
  ``h = a + residual`` (rounded to the activation dtype, as a separate add would be) and ``y = norm(h)`` in one pass;
  the backward writes ``dh = norm_backward(dy) + d_h`` once and returns it as the gradient of both ``a`` and
  ``residual``.

For FP8 training with delayed scaling (TE's ``DelayedScaling``) the forward can write its output straight in FP8
(``fp8_output``): ``y * scale`` saturated to E4M3's range and rounded once from float32, the largest ``|y|`` folded
into the amax that the next scale is computed from, and ``1 / scale`` written for the GEMM, as TE's LayerNorm does
when it feeds an FP8 GEMM. That spares the pass that would read the bf16 output back to cast it.

Arithmetic is float32 per row, rounded once to the activation dtype, as TE's norm kernels do: RMSNorm
``y = x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x^2) + eps)``; LayerNorm ``y = (x - mean) * rstd * weight + bias``
with ``rstd = 1 / sqrt(mean((x - mean)^2) + eps)``. The weight's (and bias's) gradient is summed per block of rows in
float32 and then over the blocks. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (tests);
``rms_norm_reference`` and ``layer_norm_reference`` are the plain torch formulas they are checked against.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the TE layer that uses this runs on CUDA, where torch brings Triton
    triton = None


def available() -> bool:
    return triton is not None


# Forward and backward handle a [rows, BLOCK] tile of rows at a time (BLOCK: the row width rounded up to a power of
# two); each backward program loops over tiles until it has covered _BACKWARD_ROWS rows, so that its weight-gradient
# partial sum covers that many rows (fewer partials to sum). ``_tile`` picks the tile's rows and the warps that run it.
_BACKWARD_ROWS = 64
# The partial sums ([programs, features] float32) are added up by one more kernel, each of its programs summing
# _FINALIZE_COLS features over all partials, _FINALIZE_PARTIALS at a time, and writing the weight's (and bias's)
# gradient in the weight's dtype: one launch where torch's sum over dim 0 and cast took two per gradient.
_FINALIZE_PARTIALS = 64
_FINALIZE_COLS = 32

# With FP8 output each forward program covers this many tiles, so that fewer programs fold their amax into the one
# shared value (an atomic each). Two was the fastest of 1-32 at ESM-2 650M's norm (one H200, docs/benchmarks.md).
_FP8_FORWARD_TILES = 2
# The largest finite FP8 E4M3 value: the FP8 output saturates there, as TE's casts do (``satfinite``).
FP8_E4M3_MAX = 448.0

_KERNELS = None
_add = _max = None  # the reductions' combine functions, JIT-decorated with the kernels


def _kernels():
    """The three Triton kernels, JIT-decorated on first use (so that ``TRITON_INTERPRET`` set by a test is honoured).

    Sums go through ``tl.reduce`` with a combine function decorated here, and zeros through ``tl.full``, rather than
    ``tl.sum`` and ``tl.zeros``: those were decorated when Triton was imported, and Triton's interpreter cannot call
    them unless it was on at import time. ``CENTERED`` selects LayerNorm (subtract the row mean, add a bias), else
    RMSNorm."""
    global _KERNELS, _add, _max
    if _KERNELS is None:

        def add(a, b):
            return a + b

        def maximum(a, b):
            return tl.maximum(a, b)

        _add, _max = triton.jit(add), triton.jit(maximum)

        def norm_forward(
            x_ptr,
            add_ptr,
            sum_ptr,
            y_ptr,
            weight_ptr,
            bias_ptr,
            mean_ptr,
            rstd_ptr,
            scale_ptr,
            amax_ptr,
            scale_inv_ptr,
            num_rows,
            num_cols,
            eps,
            HAS_ADD: tl.constexpr,
            CENTERED: tl.constexpr,
            FP8_OUT: tl.constexpr,
            FP8_MAX: tl.constexpr,
            ROWS: tl.constexpr,
            CHUNKS: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            cols = tl.arange(0, BLOCK)
            col_mask = cols < num_cols
            weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            if CENTERED:
                bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            if FP8_OUT:
                scale = tl.load(scale_ptr)
                row_amax = tl.full([ROWS], 0.0, dtype=tl.float32)  # per row of the tile, over the program's tiles
            for chunk in range(CHUNKS):
                rows = (tl.program_id(0) * CHUNKS + chunk) * ROWS + tl.arange(0, ROWS)
                row_mask = rows < num_rows
                mask = row_mask[:, None] & col_mask[None, :]
                offsets = rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
                x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                if HAS_ADD:
                    total = (x + tl.load(add_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(
                        sum_ptr.dtype.element_ty
                    )
                    tl.store(sum_ptr + offsets, total, mask=mask)
                    x = total.to(tl.float32)  # normalise the rounded sum, which is what the next layer reads
                if CENTERED:
                    mean = tl.reduce(x, 1, _add) / num_cols
                    tl.store(mean_ptr + rows, mean, mask=row_mask)
                    x = tl.where(mask, x - mean[:, None], 0.0)  # the padding columns stay out of the variance
                rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, _add) / num_cols + eps)
                tl.store(rstd_ptr + rows, rstd, mask=row_mask)
                y = x * rstd[:, None] * weight[None, :]
                if CENTERED:
                    y += bias[None, :]
                if FP8_OUT:
                    # (a padding row of a LayerNorm holds the bias here: kept out of the amax)
                    row_amax = tl.maximum(row_amax, tl.reduce(tl.where(mask, tl.abs(y), 0.0), 1, _max))
                    y = tl.clamp(y * scale, -FP8_MAX, FP8_MAX)
                tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
            if FP8_OUT:
                # One atomic per program into the amax that all programs raise, and only where it would raise it:
                # atomics on one address queue up (12,288 of them took ~25 us of a 150 us kernel at 650M's 49,152
                # rows), and once the largest values are in, most programs skip theirs. The amax only grows, so a
                # stale read can cost an atomic, never lose one.
                program_amax = tl.reduce(row_amax, 0, _max)
                if program_amax > tl.load(amax_ptr):
                    tl.atomic_max(amax_ptr, program_amax)
                if tl.program_id(0) == 0:
                    tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))

        def norm_backward(
            dy_ptr,
            x_ptr,
            weight_ptr,
            mean_ptr,
            rstd_ptr,
            residual_grad_ptr,
            dx_ptr,
            weight_grad_ptr,
            bias_grad_ptr,
            num_rows,
            num_cols,
            HAS_RESIDUAL_GRAD: tl.constexpr,
            CENTERED: tl.constexpr,
            WEIGHT_PER_TILE: tl.constexpr,
            ROWS: tl.constexpr,
            CHUNKS: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            program = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            col_mask = cols < num_cols
            # A 16-bit weight is held across the loop. A float32 weight (fp32 master weights) held there made this
            # kernel 276 us at 1,280 features x 49,152 rows against 190 us with a bf16 one; read again for every tile
            # (from cache) it takes 233 us, while that would slow the 16-bit case (190 -> 196 us) (one H200).
            if not WEIGHT_PER_TILE:
                weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            weight_grad = tl.full([BLOCK], 0.0, dtype=tl.float32)
            bias_grad = tl.full([BLOCK], 0.0, dtype=tl.float32)
            for chunk in range(CHUNKS):
                rows = (program * CHUNKS + chunk) * ROWS + tl.arange(0, ROWS)
                row_mask = rows < num_rows
                mask = row_mask[:, None] & col_mask[None, :]
                offsets = rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
                x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                if CENTERED:
                    mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
                    x = tl.where(mask, x - mean[:, None], 0.0)
                x_hat = x * rstd[:, None]
                if WEIGHT_PER_TILE:
                    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                weighted_dy = dy * weight[None, :]
                projection = tl.reduce(x_hat * weighted_dy, 1, _add) / num_cols
                dx = weighted_dy - x_hat * projection[:, None]
                if CENTERED:  # the mean's gradient: every input moved the mean by 1 / num_cols
                    dx -= (tl.reduce(weighted_dy, 1, _add) / num_cols)[:, None]
                dx *= rstd[:, None]
                if HAS_RESIDUAL_GRAD:
                    dx += tl.load(residual_grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                weight_grad += tl.reduce(dy * x_hat, 0, _add)
                if CENTERED:
                    bias_grad += tl.reduce(dy, 0, _add)
            tl.store(weight_grad_ptr + program * num_cols + cols, weight_grad, mask=col_mask)
            if CENTERED:
                tl.store(bias_grad_ptr + program * num_cols + cols, bias_grad, mask=col_mask)

        def sum_partials(
            weight_partials_ptr,
            bias_partials_ptr,
            weight_grad_ptr,
            bias_grad_ptr,
            num_partials,
            num_cols,
            CENTERED: tl.constexpr,
            PARTIALS: tl.constexpr,
            COLS: tl.constexpr,
        ):
            cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
            col_mask = cols < num_cols
            weight_grad = tl.full([COLS], 0.0, dtype=tl.float32)
            bias_grad = tl.full([COLS], 0.0, dtype=tl.float32)
            for start in range(0, num_partials, PARTIALS):
                partials = start + tl.arange(0, PARTIALS)
                mask = (partials < num_partials)[:, None] & col_mask[None, :]
                offsets = partials[:, None] * num_cols + cols[None, :]
                weight_grad += tl.reduce(tl.load(weight_partials_ptr + offsets, mask=mask, other=0.0), 0, _add)
                if CENTERED:
                    bias_grad += tl.reduce(tl.load(bias_partials_ptr + offsets, mask=mask, other=0.0), 0, _add)
            tl.store(weight_grad_ptr + cols, weight_grad.to(weight_grad_ptr.dtype.element_ty), mask=col_mask)
            if CENTERED:
                tl.store(bias_grad_ptr + cols, bias_grad.to(bias_grad_ptr.dtype.element_ty), mask=col_mask)

        _KERNELS = (triton.jit(norm_forward), triton.jit(norm_backward), triton.jit(sum_partials))
    return _KERNELS


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _tile(num_cols: int) -> tuple[int, int, int]:
    """(BLOCK, rows per tile, warps per program) for rows of ``num_cols`` features.

    The backward keeps several float32 tiles live at once (input, output gradient, normalised input, input
    gradient). Four rows per tile on four warps suit rows of up to 2,048 values (ESM-2 650M, AMPLIFY); wider tiles
    spill out of registers and slow the kernels down many times over (ESM-2 3B's 2,560 features as [4, 4096] tiles on
    four warps: 2.9 ms per backward call where TE's LayerNorm takes 0.17 ms), so wider rows get more warps, and rows
    wider than 4,096 values one row per tile. Chosen by a sweep on one H200 (rows 1-8 x warps 2-16, 640-5,120
    features): for the norms the models use (LayerNorm at 1,280, 2,560 and 5,120 features, RMSNorm at 640 and 960)
    these tiles are the fastest or within 10% of it, forward plus backward (docs/benchmarks.md)."""
    block = triton.next_power_of_2(num_cols)
    rows = 4 if block <= 4096 else 1
    warps = max(4, min(16, block // 512))
    return block, rows, warps


def _check(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.shape != like.shape or not tensor.is_contiguous() or tensor.device != like.device:
        raise ValueError(
            f"{name} must be a contiguous tensor shaped like the input {tuple(like.shape)} on {like.device}, got "
            f"{tuple(tensor.shape)} on {tensor.device} (contiguous: {tensor.is_contiguous()})"
        )


def _check_affine(name: str, tensor: torch.Tensor, num_cols: int) -> None:
    if tensor.shape != (num_cols,):
        raise ValueError(f"{name} {tuple(tensor.shape)} must have one entry per feature ({num_cols})")


class FP8Output(NamedTuple):
    """Where a norm's forward writes FP8 E4M3 rather than the activation dtype (delayed scaling).

    ``scale`` (one float32) is read; the largest ``|y|`` is folded into ``amax`` (one float32, in place, as TE's casts
    fold theirs into the current amax history entry); ``wrap(data, scale_inv, dtype)`` turns the E4M3 data and its
    ``1 / scale`` (a new one-element tensor) into what the norm returns: TE's ``Float8Tensor`` in the fused layers,
    presenting as ``dtype``."""

    scale: torch.Tensor
    amax: torch.Tensor
    wrap: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def _check_fp8_output(fp8_output: FP8Output, device: torch.device) -> None:
    for name in ("scale", "amax"):
        tensor = getattr(fp8_output, name)
        if tensor.numel() != 1 or tensor.dtype != torch.float32 or tensor.device != device:
            raise ValueError(
                f"the FP8 {name} must be one float32 value on {device}, got {tuple(tensor.shape)} "
                f"{tensor.dtype} on {tensor.device}"
            )


def norm_forward(x, weight, bias, eps: float, add=None, fp8_output: FP8Output | None = None):
    """(y, h, mean, rstd): ``h = x + add`` (None without ``add``), ``y = norm(h or x)`` (LayerNorm with ``bias``,
    RMSNorm without), and per row the mean (LayerNorm only, else None) and ``rstd`` (float32). With ``fp8_output``,
    ``y`` is ``fp8_output.wrap`` of its E4M3 form (see ``FP8Output``)."""
    x = x.contiguous()
    num_cols = x.shape[-1]
    _check_affine("weight", weight, num_cols)
    if bias is not None:
        _check_affine("bias", bias, num_cols)
    if add is not None:
        add = add.contiguous()
        _check("the residual", add, x)
    fp8 = fp8_output is not None
    if fp8:
        _check_fp8_output(fp8_output, x.device)
    rows = _rows(x)
    num_rows = rows.shape[0]
    y = torch.empty_like(x, dtype=torch.float8_e4m3fn if fp8 else None)
    total = torch.empty_like(x) if add is not None else None
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    mean = torch.empty(num_rows, dtype=torch.float32, device=x.device) if bias is not None else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device) if fp8 else None
    if num_rows:
        forward, _, _ = _kernels()
        block, tile_rows, warps = _tile(num_cols)
        chunks = _FP8_FORWARD_TILES if fp8 else 1
        forward[(triton.cdiv(num_rows, tile_rows * chunks),)](
            rows,
            add if add is not None else rows,
            total if total is not None else y,
            y,
            weight,
            bias if bias is not None else weight,
            mean if mean is not None else rstd,
            rstd,
            fp8_output.scale if fp8 else rstd,
            fp8_output.amax if fp8 else rstd,
            scale_inv if fp8 else rstd,
            num_rows,
            num_cols,
            eps,
            HAS_ADD=add is not None,
            CENTERED=bias is not None,
            FP8_OUT=fp8,
            FP8_MAX=FP8_E4M3_MAX,
            ROWS=tile_rows,
            CHUNKS=chunks,
            BLOCK=block,
            num_warps=warps,
        )
    elif fp8:
        scale_inv.copy_(fp8_output.scale.reciprocal().reshape(1))
    if fp8:
        y = fp8_output.wrap(y, scale_inv, x.dtype)
    return y, total, mean, rstd


def norm_backward(dy, x, weight, mean, rstd, residual_grad=None):
    """(dx, d_weight, d_bias): the norm's input gradient, plus ``residual_grad`` where given, and the weight's and
    (LayerNorm: ``mean`` given) the bias's gradient (None for RMSNorm)."""
    x, dy = x.contiguous(), dy.contiguous()
    _check("the output gradient", dy, x)
    if residual_grad is not None:
        residual_grad = residual_grad.contiguous()
        _check("the residual gradient", residual_grad, x)
    num_rows, num_cols = _rows(x).shape
    centered = mean is not None
    dx = torch.empty_like(x)
    weight_grad = torch.empty(num_cols, dtype=weight.dtype, device=x.device)
    bias_grad = torch.empty_like(weight_grad) if centered else None
    if not num_rows:
        weight_grad.zero_()
        if centered:
            bias_grad.zero_()
        return dx, weight_grad, bias_grad
    block, tile_rows, warps = _tile(num_cols)
    programs = triton.cdiv(num_rows, _BACKWARD_ROWS)
    partial_weight_grads = torch.empty(programs, num_cols, dtype=torch.float32, device=x.device)
    partial_bias_grads = torch.empty_like(partial_weight_grads) if centered else partial_weight_grads
    _, backward, sum_partials = _kernels()
    backward[(programs,)](
        _rows(dy),
        _rows(x),
        weight,
        mean if centered else rstd,
        rstd,
        _rows(residual_grad) if residual_grad is not None else _rows(dy),
        dx,
        partial_weight_grads,
        partial_bias_grads,
        num_rows,
        num_cols,
        HAS_RESIDUAL_GRAD=residual_grad is not None,
        CENTERED=centered,
        WEIGHT_PER_TILE=weight.dtype == torch.float32,
        ROWS=tile_rows,
        CHUNKS=_BACKWARD_ROWS // tile_rows,
        BLOCK=block,
        num_warps=warps,
    )
    sum_partials[(triton.cdiv(num_cols, _FINALIZE_COLS),)](
        partial_weight_grads,
        partial_bias_grads,
        weight_grad,
        bias_grad if centered else weight_grad,
        programs,
        num_cols,
        CENTERED=centered,
        PARTIALS=_FINALIZE_PARTIALS,
        COLS=_FINALIZE_COLS,
        num_warps=4,
    )
    return dx, weight_grad, bias_grad


class _NormKeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, fp8_output):
        x = x.contiguous()  # what the kernels read and what is handed on as the residual
        y, _, mean, rstd = norm_forward(x, weight, bias, eps, fp8_output=fp8_output)
        ctx.save_for_backward(x, weight, mean, rstd)
        # x is returned as is (autograd makes it a view of the input): the residual path's use of it sends its
        # gradient here, into the same kernel as the norm's. (A strided input was copied above; the copy goes on.)
        return y, x

    @staticmethod
    def backward(ctx, dy, residual_grad):
        x, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, weight_grad, bias_grad = norm_backward(dy, x, weight, mean, rstd, residual_grad)
        return dx, weight_grad, bias_grad, None, None


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, residual, weight, bias, eps: float, fp8_output):
        y, total, mean, rstd = norm_forward(residual, weight, bias, eps, add=a, fp8_output=fp8_output)
        ctx.save_for_backward(total, weight, mean, rstd)
        return y, total

    @staticmethod
    def backward(ctx, dy, total_grad):
        total, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(total)
        d_total, weight_grad, bias_grad = norm_backward(dy, total, weight, mean, rstd, total_grad)
        return d_total, d_total, weight_grad, bias_grad, None, None


# ``fp8_output`` (all four): write the norm's output in FP8 (see ``FP8Output``); its gradient arrives in the
# activation dtype.


def rms_norm_keep_input(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_output: FP8Output | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x) * weight, x)``; use the second output for the residual path (see the module docstring)."""
    return _NormKeepInput.apply(x, weight, None, eps, fp8_output)


def add_rms_norm(
    a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp8_output: FP8Output | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(h) * weight, h)`` with ``h = a + residual`` (see the module docstring)."""
    return _AddNorm.apply(a, residual, weight, None, eps, fp8_output)


def layer_norm_keep_input(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, fp8_output: FP8Output | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layernorm(x) * weight + bias, x)``; use the second output for the residual path."""
    return _NormKeepInput.apply(x, weight, bias, eps, fp8_output)


def add_layer_norm(
    a: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    fp8_output: FP8Output | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layernorm(h) * weight + bias, h)`` with ``h = a + residual``."""
    return _AddNorm.apply(a, residual, weight, bias, eps, fp8_output)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm in plain torch, float32 per row, rounded once to ``x``'s dtype (tests compare with it)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The LayerNorm in plain torch, float32 per row, rounded once to ``x``'s dtype (tests compare with it)."""
    x32 = x.float()
    centered = x32 - x32.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    return (centered * rstd * weight.float() + bias.float()).to(x.dtype)
