# Copied from common/compensated_adamw.py — edit the source, then run ci/check_copies.py --fix
"""AdamW for bf16 parameters that learns as fp32 master weights do: each weight's 16 low float32 bits are kept.

A bf16 number keeps 8 bits of mantissa: a weight of 0.02 can only move in steps of about 1.2e-4. AdamW moves each
weight by about the learning rate per step, so while the learning rate is small (the warm-up of a from-scratch run, the
tail of a decay, fine-tuning at 1e-5) a plain bf16 update rounds back to the weight it started from. Measured on one
H100 (docs/benchmarks.md): ESM-2 650M with bf16 parameters and torch's AdamW trailed the same run with fp32 master
weights by 0.52 in loss at step 10 and by 0.10 at step 50 of a 2,000-step warm-up.

A float32 number is a bf16 number plus 16 more mantissa bits. ``CompensatedAdamW`` keeps those 16 bits: next to each
bf16 parameter an int16 ``compensation`` tensor holds the low half of the parameter's float32 master value, and the
parameter itself is the master value rounded to the nearest bf16 (bit-wise: the high half, plus one where the low half
is at least 0x8000). Each step joins the two halves into the exact float32 master weight, applies torch's AdamW
arithmetic to it in float32, and splits the result again. The optimizer therefore follows fp32 master weights bit for
bit (for the same gradients), and the model computes with what autocast would have cast them to, while holding 2 bytes
per parameter more than a plain bf16 model instead of an fp32 copy (4 bytes) plus its fp32 gradient (4 more).

Where the low bits start matters as much as keeping them. Weights initialised in float32 sit anywhere between two
bf16 values; a small update then flips a share of the bf16 weights the GEMMs see in proportion to its size, so the
forward pass follows updates far below one bf16 step on average. Low bits of zero put every weight exactly on its bf16
value, and nothing moves until an update has added up to half a step: on ESM-2 650M that kept the loss 0.39 above the
fp32-master run at step 10. So by default (``initial_compensation="dither"``) the low bits of every matrix (2-D or
more: the randomly initialised weights) start uniformly random, as a float32 initialisation would have left them;
vectors (biases, norm scales: constants at init) and zeros start at zero. The random bits come from a generator
seeded with ``seed``, not from the global RNG. ``initial_compensation="zero"`` starts all of them at zero (the master
weights then equal the bf16 ones, e.g. after loading a bf16 checkpoint). Given the low halves themselves (a dict from
parameter to int16 tensor, as ``split_float32_masters`` returns them for a model built in float32 and then made bf16),
the master weights start as exactly those float32 weights: fp32 master weights kept in the optimizer
(``mixed_precision.masters_in_optimizer``; ``master_state_dict`` gives them back, for an export).

The moments ``exp_avg`` and ``exp_avg_sq`` are stored in the parameter's dtype by default, as torch's AdamW does for
bf16 parameters (``state_dtype=torch.float32`` keeps them in fp32). float32 parameters get plain AdamW (no low bits):
the recipes' fp32-weight runs on CUDA use it for that (adamw.py), for the kernel and ``grad_scale`` below.
The arithmetic is ``torch.optim.AdamW``'s (decoupled weight decay, ``lerp`` of the first moment, ``eps`` added to the
bias-corrected square root), in float32: on CUDA one Triton kernel launch for all the parameters of the same dtypes
and step (a multi-tensor kernel, as torch's fused AdamW), elsewhere torch, tensor by tensor.

``step(grad_scale=c)`` multiplies every gradient by ``c`` (a float, or a one-element tensor left on the GPU) as it
reads it, in float32, and leaves the gradients as they were: gradient clipping's factor applied without the pass that
would rewrite every gradient first (``grad_clipping.clip_grad_norm_and_step``). That pass read and wrote 5.7 GB of
bf16 gradients per ESM-2 3B step. In-place clipping rounds each scaled bf16 gradient to bf16; here the product stays
float32, so clipped steps differ from it by that rounding.

Parameters may be plain tensors or FSDP2's DTensors (each rank updates its own shard). The state dict has torch's
AdamW keys plus ``compensation``, so checkpoints save and restore it like any optimizer state.
"""

import math
from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below does the same arithmetic
    triton = None


class CompensatedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` on the float32 master weights that bf16 parameters and their low bits make up."""

    # ``step`` takes ``grad_scale``: gradient clipping can hand it its factor (grad_clipping.clip_grad_norm_and_step)
    scales_gradients_in_step = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype | None = None,
        initial_compensation: str | dict = "dither",
        seed: int = 0,
    ):
        if not lr >= 0.0:
            raise ValueError(f"CompensatedAdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CompensatedAdamW: betas must be in [0, 1), got {tuple(betas)}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"CompensatedAdamW: eps and weight_decay must be >= 0, got {eps} and {weight_decay}")
        given_low_bits = isinstance(initial_compensation, dict)
        if not given_low_bits and initial_compensation not in ("dither", "zero"):
            raise ValueError(
                "CompensatedAdamW: initial_compensation must be 'dither', 'zero' or a dict of low halves, got "
                f"{initial_compensation!r}"
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype not in (torch.bfloat16, torch.float32):
                    raise TypeError(f"CompensatedAdamW takes bf16 or float32 parameters, got {param.dtype}")
        self.state_dtype = state_dtype
        # Given low halves are taken over: each leaves the dict when its parameter's state is made (2 bytes a weight).
        self._given_low_bits = initial_compensation if given_low_bits else {}
        self.initial_compensation = "given" if given_low_bits else initial_compensation
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._block_tables = _BlockTables()

    def _init_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            moment_dtype = self.state_dtype or param.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # on the CPU, as torch's AdamW: no device sync
            state["exp_avg"] = torch.zeros_like(param, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=moment_dtype, memory_format=torch.preserve_format)
            if param.dtype == torch.bfloat16:
                low = torch.zeros_like(param, dtype=torch.int16, memory_format=torch.preserve_format)
                given = self._given_low_bits.pop(param, None)
                if given is not None:
                    _local(low).copy_(_local(given))
                elif self.initial_compensation == "dither" and param.dim() >= 2:
                    local = _local(low)
                    local.copy_(random_low_bits(_local(param), self._generator(local.device)))
                state["compensation"] = low
        elif param.dtype == torch.bfloat16 and "compensation" not in state:
            # Moments from torch's AdamW (a run resumed with compensate_bf16_updates switched on): the weights are
            # trained bf16 values, their master values are those bf16 values, so the low bits start at zero.
            state["compensation"] = torch.zeros_like(param, dtype=torch.int16, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the state keeps its saved dtypes: torch casts the state of a floating-point parameter
        to the parameter's dtype, which would turn the int16 low halves (and float32 moments) into bf16 numbers."""
        saved = {
            param_id: {key: value for key, value in state.items() if key != "step" and torch.is_tensor(value)}
            for param_id, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        self._given_low_bits.clear()  # a resumed run's low halves are the checkpoint's
        params_by_id = {
            param_id: param
            for saved_group, group in zip(state_dict["param_groups"], self.param_groups)
            for param_id, param in zip(saved_group["params"], group["params"])
        }
        for param_id, tensors in saved.items():
            param = params_by_id[param_id]
            for key, value in tensors.items():
                self.state[param][key] = value.to(device=param.device)
        for state in self.state.values():  # torch's fused AdamW keeps the step count on the GPU: reading it would sync
            if torch.is_tensor(state.get("step")) and state["step"].device.type != "cpu":
                state["step"] = state["step"].cpu()

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float | torch.Tensor | None = None):
        """One AdamW step on every parameter with a gradient; with ``grad_scale``, on the gradients times that factor
        (a float, or a one-element tensor: read on the device, no host sync), which are left unchanged."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scales = _GradScales(grad_scale)
        # Tensors the kernel takes, gathered into one launch per step count, device and dtypes; the others (CPU,
        # non-contiguous) through the torch path one by one.
        launches: dict[tuple, list[tuple]] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            scalars_by_step: dict[int, AdamWScalars] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("CompensatedAdamW does not support sparse gradients")
                state = self._init_state(param)
                state["step"] += 1
                step = int(state["step"].item())
                if step not in scalars_by_step:
                    # Scalars in float64 on the host, as torch's AdamW computes them; both paths round them to fp32.
                    scalars_by_step[step] = AdamWScalars(
                        decay=1.0 - lr * group["weight_decay"],
                        one_minus_beta1=1.0 - beta1,
                        beta2=beta2,
                        one_minus_beta2=1.0 - beta2,
                        step_size=lr / (1.0 - beta1**step),
                        sqrt_bias_correction2=math.sqrt(1.0 - beta2**step),
                        eps=group["eps"],
                    )
                scalars = scalars_by_step[step]
                low = state.get("compensation")
                tensors = tuple(
                    None if t is None else _local(t)
                    for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"], low)
                )
                if tensors[0].numel() == 0:
                    continue
                if _fits_the_kernel(tensors):
                    # 16-byte aligned tensors (all of them, unless views into a flat buffer) get their own launch,
                    # which can vectorise its loads
                    key = (
                        scalars,
                        tensors[0].device,
                        *(t.dtype for t in tensors[:3]),
                        low is not None,
                        _aligned(tensors),
                    )
                    launches.setdefault(key, []).append(tensors)
                else:
                    update_with_torch(*tensors, scalars, grad_scales.on(tensors[0].device))
        for (scalars, device, *_), tensors in launches.items():
            update_many_with_triton(tensors, scalars, self._block_tables, grad_scales.on(device))
        return loss


class _GradScales:
    """``step``'s ``grad_scale`` as a one-element float32 tensor on each device that asks for it (None: no scaling)."""

    def __init__(self, grad_scale: float | torch.Tensor | None):
        if torch.is_tensor(grad_scale):
            if isinstance(grad_scale, DTensor):
                grad_scale = grad_scale.full_tensor()
            if grad_scale.numel() != 1 or not grad_scale.is_floating_point():
                raise ValueError(
                    f"CompensatedAdamW: grad_scale must be one floating-point value, got a {grad_scale.dtype} "
                    f"tensor of shape {tuple(grad_scale.shape)}"
                )
            grad_scale = grad_scale.detach().reshape(()).float()
        elif grad_scale is not None:
            grad_scale = torch.tensor(float(grad_scale), dtype=torch.float32)
        self._scale = grad_scale
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor | None:
        if self._scale is None:
            return None
        if device not in self._by_device:
            # from the host without waiting; from a GPU to the host (a CPU parameter) the copy must wait
            self._by_device[device] = self._scale.to(device, non_blocking=self._scale.device.type == "cpu")
        return self._by_device[device]


@dataclass(frozen=True)
class AdamWScalars:
    """The per-step numbers of one AdamW update, shared by the Triton kernel and the torch path."""

    decay: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    sqrt_bias_correction2: float
    eps: float


@torch.no_grad()
def split_float32_masters(module: torch.nn.Module) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Make a float32 ``module`` bf16 (``module.to(torch.bfloat16)``: parameters and buffers) and return each float32
    parameter's int16 low half, by parameter: ``CompensatedAdamW(initial_compensation=...)`` then starts from
    exactly the float32 weights. Each bf16 weight is its master value rounded as ``split_master`` rounds it (to
    nearest, ties away from zero), so weight and low half join back into the float32 value."""
    halves = {param: split_master(param.detach()) for param in module.parameters() if param.dtype == torch.float32}
    module.to(torch.bfloat16)
    for param, (high, _) in halves.items():
        param.copy_(high)  # the cast rounds ties to even; the low half assumes ties away from zero
    return {param: low for param, (_, low) in halves.items()}


@torch.no_grad()
def master_state_dict(model: torch.nn.Module, optimizer: "CompensatedAdamW") -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each bf16 parameter that ``optimizer`` keeps low bits for replaced by its float32
    master value (bf16 weight and low half joined): what an fp32-master run exports. Parameters the optimizer has not
    stepped yet count as their low halves given at construction, else as their bf16 values."""
    state = model.state_dict()
    for name, param in model.named_parameters(remove_duplicate=False):  # tied weights: under each of their names
        low = optimizer.state.get(param, {}).get("compensation")
        if low is None:
            low = optimizer._given_low_bits.get(param)
        if low is not None and name in state:
            state[name] = join_master(_local(param.detach()), _local(low))
    return state


def random_low_bits(param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random low halves for bf16 ``param``: master values spread over all float32 numbers that round to
    each bf16 value. Zero where ``param`` is ±0 (a negative low half there would flip the sign or make a NaN)."""
    low = torch.randint(-(2**15), 2**15, param.shape, generator=generator, device=param.device, dtype=torch.int32)
    return torch.where(param == 0, 0, low).to(torch.int16)


def join_master(param: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 master values of bf16 ``param`` and its int16 low halves."""
    high = param.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((high << 16) + low.to(torch.int64)) & 0xFFFFFFFF
    return _wrap(bits, 32).to(torch.int32).view(torch.float32)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``master`` as (its nearest bf16 value, the int16 low half that restores it exactly)."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = (bits + 0x8000) >> 16  # rounds to nearest (ties away from zero): the bit pattern is monotonic in |value|
    low = bits - (high << 16)  # in [-0x8000, 0x7FFF]
    param = _wrap(high & 0xFFFF, 16).to(torch.int16).view(torch.bfloat16)
    return param, low.to(torch.int16)


def _wrap(unsigned: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned ``width``-bit integers (in int64) as the signed integers with the same bits."""
    return torch.where(unsigned >= 2 ** (width - 1), unsigned - 2**width, unsigned)


def update_with_torch(param, grad, exp_avg, exp_avg_sq, low, scalars: AdamWScalars, grad_scale=None) -> None:
    """The reference arithmetic: torch's (single-tensor) AdamW in float32, on the joined master weights, of the
    gradient times ``grad_scale`` (a one-element float32 tensor on the gradient's device; None: 1)."""
    f32 = torch.float32
    s = AdamWScalars(
        **{name: torch.tensor(value, dtype=f32) for name, value in asdict(scalars).items()}
    )  # as the kernel
    g = grad.to(f32)
    if grad_scale is not None:
        g = g * grad_scale
    m = exp_avg.to(f32)
    m = m + (g - m) * s.one_minus_beta1  # lerp(m, g, 1 - beta1)
    v = exp_avg_sq.to(f32) * s.beta2 + s.one_minus_beta2 * g * g  # addcmul's order: value * grad * grad
    denom = v.sqrt() / s.sqrt_bias_correction2 + s.eps
    master = param.to(f32) if low is None else join_master(param, low)
    master = master * s.decay
    master = master - s.step_size * (m / denom)
    if low is None:
        param.copy_(master)
    else:
        new_param, new_low = split_master(master)
        param.copy_(new_param)
        low.copy_(new_low)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


# One block of 1,024 elements per program on four warps: eight elements, one 16-byte vector of each bf16 array, per
# thread. Timed on one H200 (ESM-2 3B's 2,839M bf16 parameters, 18 bytes each): 12.5 ms per step (4.1 TB/s); 2,048 on
# four warps 21.7 ms, on eight 13.1; 4,096: 16.3 (four) and 22.3 (eight); the unvectorised kernel before 26.2
# (docs/benchmarks.md).
_BLOCK = 1024
_NUM_WARPS = 4
_KERNEL = None
_update_block = None  # the kernel's body for one block, JIT-decorated with it (a global: Triton resolves names there)


def _kernel():
    """The Triton kernel, JIT-decorated on first use (so that ``TRITON_INTERPRET`` set by a test is honoured).

    One launch updates many tensors of the same dtypes (a multi-tensor kernel, as torch's fused AdamW): a launch per
    parameter would cost ~70 us of host time each in Triton's launcher, ~45 ms a step for ESM-2 650M's ~400 tensors,
    which the GPU waits for whenever the host has not run ahead (Megatron-FSDP's optimizer step waits for the
    gradients first). Each program updates one ``BLOCK`` of one tensor: ``block_tensor`` and ``block_start`` say
    which tensor and where in it; ``addresses`` holds each tensor's five data pointers (param, grad, exp_avg,
    exp_avg_sq, low halves) and ``numels`` its length.

    Triton loads 16 bytes per thread at once only where it can prove the address aligned and the mask constant
    over those bytes. Pointers read from a table prove nothing, and ``offsets < numel`` with ``numel`` read from memory
    is not known constant over 8 elements, so the kernel moved every element on its own (~1.9 TB/s on an H200). With
    ``ALIGNED`` (every array of the launch 16-byte aligned, checked on the host: the caching allocator's tensors are)
    the pointers are marked aligned and a block that lies wholly inside its tensor runs without a mask; the last,
    partial block of a tensor and unaligned launches (views into a flat buffer) keep the mask. Same arithmetic, same
    bits.
    """
    global _KERNEL, _update_block
    if _KERNEL is None:

        def update_block(
            pointers,
            offsets,
            mask,
            scalars,
            grad_scale,
            PARAM: tl.constexpr,
            MOMENT: tl.constexpr,
            SPLIT: tl.constexpr,
            SCALE_GRAD: tl.constexpr,
        ):
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, low_ptr = pointers
            decay, one_minus_beta1, beta2, one_minus_beta2, step_size, sqrt_bias_correction2, eps = scalars
            g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
            if SCALE_GRAD:
                g = g * grad_scale
            m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
            m = m + (g - m) * one_minus_beta1
            v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32) * beta2 + one_minus_beta2 * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bias_correction2) + eps
            if SPLIT:  # join: (high half << 16) + low half, the float32 bit pattern (int32 arithmetic wraps)
                high = tl.load(param_ptr + offsets, mask=mask).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                low = tl.load(low_ptr + offsets, mask=mask).to(tl.int32)
                master = ((high << 16) + low).to(tl.float32, bitcast=True)
            else:
                master = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
            master = master * decay
            master = master - step_size * tl.div_rn(m, denom)
            if SPLIT:  # split: round the bit pattern to its high half, keep the remainder
                bits = master.to(tl.int32, bitcast=True)
                high = ((bits + 0x8000) >> 16) & 0xFFFF
                low = bits - (high << 16)
                tl.store(param_ptr + offsets, high.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
                tl.store(low_ptr + offsets, low.to(tl.int16), mask=mask)
            else:
                tl.store(param_ptr + offsets, master.to(PARAM), mask=mask)
            tl.store(exp_avg_ptr + offsets, m.to(MOMENT), mask=mask)
            tl.store(exp_avg_sq_ptr + offsets, v.to(MOMENT), mask=mask)

        _update_block = triton.jit(update_block)

        def compensated_adamw(
            addresses,
            numels,
            block_tensor,
            block_start,
            decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            step_size,
            sqrt_bias_correction2,
            eps,
            grad_scale_ptr,
            PARAM: tl.constexpr,
            GRAD: tl.constexpr,
            MOMENT: tl.constexpr,
            SPLIT: tl.constexpr,
            SCALE_GRAD: tl.constexpr,
            ALIGNED: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            tensor = tl.load(block_tensor + tl.program_id(0)).to(tl.int64)
            start = tl.load(block_start + tl.program_id(0))
            numel = tl.load(numels + tensor)
            row = addresses + tensor * 5
            param_ptr = tl.load(row).to(tl.pointer_type(PARAM))
            grad_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD))
            exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(MOMENT))
            exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(MOMENT))
            low_ptr = tl.load(row + 4).to(tl.pointer_type(tl.int16))
            # ALIGNED: every array is 16-byte aligned (checked on the host); every block starts at a multiple of
            # BLOCK elements into its tensor
            if ALIGNED:
                param_ptr = tl.multiple_of(param_ptr, 16)
                grad_ptr = tl.multiple_of(grad_ptr, 16)
                exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
                exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
                low_ptr = tl.multiple_of(low_ptr, 16)
                start = tl.multiple_of(start, BLOCK)
            offsets = start + tl.arange(0, BLOCK)
            pointers = (param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, low_ptr)
            scalars = (decay, one_minus_beta1, beta2, one_minus_beta2, step_size, sqrt_bias_correction2, eps)
            grad_scale = tl.load(grad_scale_ptr) if SCALE_GRAD else 1.0
            if ALIGNED:
                if start + BLOCK <= numel:  # a whole block: no mask, so that Triton can vectorise loads and stores
                    _update_block(pointers, offsets, None, scalars, grad_scale, PARAM, MOMENT, SPLIT, SCALE_GRAD)
                else:
                    mask = offsets < numel
                    _update_block(pointers, offsets, mask, scalars, grad_scale, PARAM, MOMENT, SPLIT, SCALE_GRAD)
            else:
                mask = offsets < numel
                _update_block(pointers, offsets, mask, scalars, grad_scale, PARAM, MOMENT, SPLIT, SCALE_GRAD)

        _KERNEL = triton.jit(compensated_adamw)
    return _KERNEL


def _triton_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


class _BlockTables:
    """Which tensor and which offset each program of a launch updates, per list of tensor lengths: built once (the
    parameters' shapes do not change) and kept on the GPU."""

    def __init__(self):
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (device, numels)
        if key not in self._tables:
            lengths = torch.tensor(numels, dtype=torch.int64)
            blocks = (lengths + _BLOCK - 1) // _BLOCK
            block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
            first_block = (torch.cumsum(blocks, 0) - blocks).repeat_interleave(blocks)
            block_start = (torch.arange(int(blocks.sum())) - first_block) * _BLOCK
            self._tables[key] = tuple(t.to(device) for t in (lengths, block_tensor, block_start))
        return self._tables[key]


def update_many_with_triton(
    tensors: list[tuple], scalars: AdamWScalars, tables: _BlockTables, grad_scale: torch.Tensor | None = None
) -> None:
    """One kernel launch for many ``(param, grad, exp_avg, exp_avg_sq, low)`` tuples of contiguous CUDA tensors with
    the same dtypes (``low`` None for every float32 ``param``, an int16 tensor for every bf16 one), on the gradients
    times ``grad_scale`` (a one-element float32 tensor on their device; None: 1)."""
    param, grad, exp_avg, _, low = tensors[0]
    numels = tuple(t[0].numel() for t in tensors)
    lengths, block_tensor, block_start = tables.get(numels, param.device)
    # The five data pointers of each tensor (a float32 parameter's unused low-half pointer is its own).
    pointers = [[t.data_ptr() for t in (p, g, m, v, p if lo is None else lo)] for p, g, m, v, lo in tensors]
    aligned = all(pointer % 16 == 0 for row in pointers for pointer in row)
    addresses = torch.tensor(pointers, dtype=torch.int64).to(param.device, non_blocking=True)
    _kernel()[(block_tensor.numel(),)](
        addresses,
        lengths,
        block_tensor,
        block_start,
        scalars.decay,
        scalars.one_minus_beta1,
        scalars.beta2,
        scalars.one_minus_beta2,
        scalars.step_size,
        scalars.sqrt_bias_correction2,
        scalars.eps,
        lengths if grad_scale is None else grad_scale,  # not read without SCALE_GRAD
        PARAM=_triton_dtype(param.dtype),
        GRAD=_triton_dtype(grad.dtype),
        MOMENT=_triton_dtype(exp_avg.dtype),
        SPLIT=low is not None,
        SCALE_GRAD=grad_scale is not None,
        ALIGNED=aligned,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )


def _fits_the_kernel(tensors: tuple) -> bool:
    present = [t for t in tensors if t is not None]
    return (
        triton is not None
        and tensors[0].is_cuda
        and all(t.is_contiguous() for t in present)
        and all(t.dtype in (torch.bfloat16, torch.float32) for t in present[:4])
        and tensors[2].dtype == tensors[3].dtype  # one dtype for both moments
    )


def _aligned(tensors: tuple) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (the update is elementwise), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
