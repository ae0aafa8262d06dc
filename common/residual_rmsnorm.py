"""RMSNorm with the pre-norm residual connection folded into its kernels (Triton), forward and backward.

A pre-norm transformer layer computes ``h = x + attention(norm_1(x))`` and ``out = h + mlp(norm_2(h))``. Built from
TE's ``TransformerLayer``, every residual costs a separate elementwise kernel each way: the forward add ``x + a``
(two reads, one write over [tokens, hidden]) and, in backward, the sum of the two gradients that reach ``x`` (through
the norm and through the residual path). Here both live inside the norm kernels:

* ``rms_norm_keep_input(x, weight, eps) -> (y, x)``: the norm, and ``x`` itself as a second output meant for the
  residual path. Its backward receives both gradients and writes ``dx = norm_backward(dy) + d_residual`` in the same
  pass over the rows that computes the norm's gradient.
* ``add_rms_norm(a, residual, weight, eps) -> (y, h)``: ``h = a + residual`` (rounded to the activation dtype, as a
  separate add would be) and ``y = rmsnorm(h)`` in one pass; the backward writes ``dh = norm_backward(dy) + d_h`` once
  and returns it as the gradient of both ``a`` and ``residual``.

Arithmetic is float32 per row (``rstd = 1 / sqrt(mean(x^2) + eps)``, ``y = x * rstd * weight``), rounded once to the
activation dtype, as TE's RMSNorm kernels do. The weight's gradient is summed per block of rows in float32 and then
over the blocks. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (tests); ``rms_norm_reference`` is the plain
torch formula they are checked against.
"""

import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the TE layer that uses this runs on CUDA, where torch brings Triton
    triton = None


def available() -> bool:
    return triton is not None


# Rows per program: forward and backward handle ROWS rows at a time as one [ROWS, BLOCK] tile; the backward loops over
# CHUNKS tiles so that each program's weight-gradient partial sum covers ROWS * CHUNKS rows (fewer partials to sum).
_ROWS = 4
_BACKWARD_CHUNKS = 16

_KERNELS = None
_add = None  # the reductions' combine function, JIT-decorated with the kernels


def _kernels():
    """The two Triton kernels, JIT-decorated on first use (so that ``TRITON_INTERPRET`` set by a test is honoured).

    Sums go through ``tl.reduce`` with a combine function decorated here, and zeros through ``tl.full``, rather than
    ``tl.sum`` and ``tl.zeros``: those were decorated when Triton was imported, and Triton's interpreter cannot call
    them unless it was on at import time."""
    global _KERNELS, _add
    if _KERNELS is None:

        def add(a, b):
            return a + b

        _add = triton.jit(add)

        def rms_norm_forward(
            x_ptr,
            add_ptr,
            sum_ptr,
            y_ptr,
            weight_ptr,
            rstd_ptr,
            num_rows,
            num_cols,
            eps,
            HAS_ADD: tl.constexpr,
            ROWS: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            cols = tl.arange(0, BLOCK)
            row_mask = rows < num_rows
            mask = row_mask[:, None] & (cols < num_cols)[None, :]
            offsets = rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_ADD:
                total = (x + tl.load(add_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(
                    sum_ptr.dtype.element_ty
                )
                tl.store(sum_ptr + offsets, total, mask=mask)
                x = total.to(tl.float32)  # normalise the rounded sum, which is what the next layer reads
            rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, _add) / num_cols + eps)
            tl.store(rstd_ptr + rows, rstd, mask=row_mask)
            weight = tl.load(weight_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * weight[None, :]
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

        def rms_norm_backward(
            dy_ptr,
            x_ptr,
            weight_ptr,
            rstd_ptr,
            residual_grad_ptr,
            dx_ptr,
            weight_grad_ptr,
            num_rows,
            num_cols,
            HAS_RESIDUAL_GRAD: tl.constexpr,
            ROWS: tl.constexpr,
            CHUNKS: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            program = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            col_mask = cols < num_cols
            weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            weight_grad = tl.full([BLOCK], 0.0, dtype=tl.float32)
            for chunk in range(CHUNKS):
                rows = (program * CHUNKS + chunk) * ROWS + tl.arange(0, ROWS)
                row_mask = rows < num_rows
                mask = row_mask[:, None] & col_mask[None, :]
                offsets = rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
                x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                x_hat = x * rstd[:, None]
                weighted_dy = dy * weight[None, :]
                projection = tl.reduce(x_hat * weighted_dy, 1, _add) / num_cols
                dx = (weighted_dy - x_hat * projection[:, None]) * rstd[:, None]
                if HAS_RESIDUAL_GRAD:
                    dx += tl.load(residual_grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                weight_grad += tl.reduce(dy * x_hat, 0, _add)
            tl.store(weight_grad_ptr + program * num_cols + cols, weight_grad, mask=col_mask)

        _KERNELS = (triton.jit(rms_norm_forward), triton.jit(rms_norm_backward))
    return _KERNELS


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _check(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.shape != like.shape or not tensor.is_contiguous() or tensor.device != like.device:
        raise ValueError(
            f"{name} must be a contiguous tensor shaped like the input {tuple(like.shape)} on {like.device}, got "
            f"{tuple(tensor.shape)} on {tensor.device} (contiguous: {tensor.is_contiguous()})"
        )


def rms_norm_forward(x, weight, eps: float, add=None):
    """(y, h, rstd): ``h = x + add`` (None without ``add``), ``y = rmsnorm(h or x)``, ``rstd`` per row (float32)."""
    x = x.contiguous()
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must have one entry per feature ({x.shape[-1]})")
    if add is not None:
        add = add.contiguous()
        _check("the residual", add, x)
    rows = _rows(x)
    num_rows, num_cols = rows.shape
    y = torch.empty_like(x)
    total = torch.empty_like(x) if add is not None else None
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        forward, _ = _kernels()
        forward[(triton.cdiv(num_rows, _ROWS),)](
            rows,
            add if add is not None else rows,
            total if total is not None else y,
            y,
            weight,
            rstd,
            num_rows,
            num_cols,
            eps,
            HAS_ADD=add is not None,
            ROWS=_ROWS,
            BLOCK=triton.next_power_of_2(num_cols),
        )
    return y, total, rstd


def rms_norm_backward(dy, x, weight, rstd, residual_grad=None):
    """(dx, d_weight): the norm's input gradient, plus ``residual_grad`` where given, and the weight's gradient."""
    x, dy = x.contiguous(), dy.contiguous()
    _check("the output gradient", dy, x)
    if residual_grad is not None:
        residual_grad = residual_grad.contiguous()
        _check("the residual gradient", residual_grad, x)
    num_rows, num_cols = _rows(x).shape
    dx = torch.empty_like(x)
    programs = max(1, triton.cdiv(num_rows, _ROWS * _BACKWARD_CHUNKS))
    partial_weight_grads = torch.empty(programs, num_cols, dtype=torch.float32, device=x.device)
    if num_rows:
        _, backward = _kernels()
        backward[(programs,)](
            _rows(dy),
            _rows(x),
            weight,
            rstd,
            _rows(residual_grad) if residual_grad is not None else _rows(dy),
            dx,
            partial_weight_grads,
            num_rows,
            num_cols,
            HAS_RESIDUAL_GRAD=residual_grad is not None,
            ROWS=_ROWS,
            CHUNKS=_BACKWARD_CHUNKS,
            BLOCK=triton.next_power_of_2(num_cols),
        )
    else:
        partial_weight_grads.zero_()
    return dx, partial_weight_grads.sum(0).to(weight.dtype)


class _RMSNormKeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x = x.contiguous()  # what the kernels read and what is handed on as the residual
        y, _, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        # x is returned as is (autograd makes it a view of the input): the residual path's use of it sends its
        # gradient here, into the same kernel as the norm's. (A strided input was copied above; the copy goes on.)
        return y, x

    @staticmethod
    def backward(ctx, dy, residual_grad):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, weight_grad = rms_norm_backward(dy, x, weight, rstd, residual_grad)
        return dx, weight_grad, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, residual, weight, eps: float):
        y, total, rstd = rms_norm_forward(residual, weight, eps, add=a)
        ctx.save_for_backward(total, weight, rstd)
        return y, total

    @staticmethod
    def backward(ctx, dy, total_grad):
        total, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(total)
        d_total, weight_grad = rms_norm_backward(dy, total, weight, rstd, total_grad)
        return d_total, d_total, weight_grad, None


def rms_norm_keep_input(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x) * weight, x)``; use the second output for the residual path (see the module docstring)."""
    return _RMSNormKeepInput.apply(x, weight, eps)


def add_rms_norm(
    a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(h) * weight, h)`` with ``h = a + residual`` (see the module docstring)."""
    return _AddRMSNorm.apply(a, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same norm in plain torch, float32 per row, rounded once to ``x``'s dtype (tests compare with it)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype)
