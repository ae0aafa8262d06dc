"""AdamW for bf16 parameters that does not lose small updates: the rounding error of each update is kept (Kahan).

A bf16 number keeps 8 bits of mantissa: a weight of 0.02 can only move in steps of about 1.2e-4. AdamW moves each
weight by about the learning rate per step, so while the learning rate is small (the warm-up of a from-scratch run, the
tail of a decay, fine-tuning at 1e-5) a plain bf16 update rounds back to the weight it started from and nothing is
learned. Measured on one H100 (docs/benchmarks.md): ESM-2 650M with bf16 parameters and torch's AdamW trailed the
same run with fp32 master weights by 0.55 in loss at step 15 and by 0.10 at step 50 of a 2,000-step warm-up.

``CompensatedAdamW`` keeps, next to each bf16 parameter, a bf16 ``compensation`` tensor holding what the last
rounding dropped. Each step computes in float32 ``parameter + compensation + update``, stores its bf16 rounding as
the parameter and the remainder as the new compensation: the pair carries ~16 bits of mantissa, so updates far below
one bf16 step add up as they would on fp32 weights. It costs 2 bytes per parameter (fp32 master weights cost 4 more,
plus 2 more for the gradient, plus fp32 optimizer moments) and one kernel per parameter tensor (Triton on CUDA).

The moments ``exp_avg`` and ``exp_avg_sq`` are stored in the parameter's dtype by default, as torch's AdamW does for
bf16 parameters (``state_dtype=torch.float32`` keeps them in fp32). The arithmetic follows ``torch.optim.AdamW``
(decoupled weight decay, bias-corrected moments, ``eps`` added to the corrected square root), in float32.

Parameters may be plain tensors or FSDP2's DTensors (each rank updates its own shard). The state dict has torch's
AdamW keys plus ``compensation``, so checkpoints save and restore it like any optimizer state.
"""

import math

import torch
from torch.distributed.tensor import DTensor


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below does the same arithmetic
    triton = None


class CompensatedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` arithmetic with Kahan-compensated parameter updates (see the module docstring)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype | None = None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"CompensatedAdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CompensatedAdamW: betas must be in [0, 1), got {tuple(betas)}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"CompensatedAdamW: eps and weight_decay must be >= 0, got {eps} and {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.state_dtype = state_dtype

    def _init_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            moment_dtype = self.state_dtype or param.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # on the CPU, as torch's AdamW: no device sync
            state["exp_avg"] = torch.zeros_like(param, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["compensation"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("CompensatedAdamW does not support sparse gradients")
                state = self._init_state(param)
                state["step"] += 1
                step = int(state["step"].item())
                # Scalars in float64 on the host, as torch's AdamW computes them; the kernel rounds them to fp32.
                scalars = AdamWScalars(
                    decay=1.0 - lr * group["weight_decay"],
                    beta1=beta1,
                    beta2=beta2,
                    step_size=lr / (1.0 - beta1**step),
                    inv_sqrt_bias_correction2=1.0 / math.sqrt(1.0 - beta2**step),
                    eps=group["eps"],
                )
                tensors = [
                    _local(t)
                    for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["compensation"])
                ]
                compensated_adamw_update(*tensors, scalars)
        return loss


class AdamWScalars:
    """The per-step numbers of one AdamW update, shared by the Triton kernel and the torch path."""

    def __init__(self, decay, beta1, beta2, step_size, inv_sqrt_bias_correction2, eps):
        self.decay = decay
        self.beta1 = beta1
        self.beta2 = beta2
        self.step_size = step_size
        self.inv_sqrt_bias_correction2 = inv_sqrt_bias_correction2
        self.eps = eps


def compensated_adamw_update(param, grad, exp_avg, exp_avg_sq, compensation, scalars: AdamWScalars) -> None:
    """One update of one tensor, in place: the Triton kernel for contiguous CUDA tensors, else the torch path."""
    tensors = (param, grad, exp_avg, exp_avg_sq, compensation)
    if param.numel() == 0:
        return
    if triton is not None and param.is_cuda and all(t.is_contiguous() for t in tensors):
        _update_with_triton(*tensors, scalars)
    else:
        update_with_torch(*tensors, scalars)


def update_with_torch(param, grad, exp_avg, exp_avg_sq, compensation, scalars: AdamWScalars) -> None:
    """The reference arithmetic, in float32 torch operations (CPU, and any tensor the kernel does not take)."""
    f32 = torch.float32
    s = {name: torch.tensor(value, dtype=f32) for name, value in vars(scalars).items()}  # fp32, as the kernel
    g = grad.to(f32)
    m = exp_avg.to(f32) * s["beta1"] + g * (1 - s["beta1"])
    v = exp_avg_sq.to(f32) * s["beta2"] + g * g * (1 - s["beta2"])
    denom = v.sqrt() * s["inv_sqrt_bias_correction2"] + s["eps"]
    exact = (param.to(f32) + compensation.to(f32)) * s["decay"] - s["step_size"] * (m / denom)
    rounded = exact.to(param.dtype)
    compensation.copy_(exact - rounded.to(f32))
    param.copy_(rounded)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


_BLOCK = 2048
_KERNEL = None


def _kernel():
    """The Triton kernel, JIT-decorated on first use (so that ``TRITON_INTERPRET`` set by a test is honoured)."""
    global _KERNEL
    if _KERNEL is None:

        def compensated_adamw(
            param_ptr,
            grad_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            compensation_ptr,
            numel,
            decay,
            beta1,
            beta2,
            step_size,
            inv_sqrt_bias_correction2,
            eps,
            BLOCK: tl.constexpr,
        ):
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < numel
            g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
            m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32) * beta1 + g * (1 - beta1)
            v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32) * beta2 + g * g * (1 - beta2)
            denom = tl.sqrt_rn(v) * inv_sqrt_bias_correction2 + eps
            p = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
            c = tl.load(compensation_ptr + offsets, mask=mask).to(tl.float32)
            exact = (p + c) * decay - step_size * tl.div_rn(m, denom)
            rounded = exact.to(param_ptr.dtype.element_ty)
            tl.store(param_ptr + offsets, rounded, mask=mask)
            tl.store(
                compensation_ptr + offsets,
                (exact - rounded.to(tl.float32)).to(compensation_ptr.dtype.element_ty),
                mask=mask,
            )
            tl.store(exp_avg_ptr + offsets, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
            tl.store(exp_avg_sq_ptr + offsets, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)

        _KERNEL = triton.jit(compensated_adamw)
    return _KERNEL


def _update_with_triton(param, grad, exp_avg, exp_avg_sq, compensation, scalars: AdamWScalars) -> None:
    numel = param.numel()
    _kernel()[(triton.cdiv(numel, _BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        compensation,
        numel,
        scalars.decay,
        scalars.beta1,
        scalars.beta2,
        scalars.step_size,
        scalars.inv_sqrt_bias_correction2,
        scalars.eps,
        BLOCK=_BLOCK,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (the update is elementwise), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
