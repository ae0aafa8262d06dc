# Copied from common/tests/test_compensated_adamw.py — edit the source, then run ci/check_copies.py --fix
"""compensated_adamw.CompensatedAdamW: bf16 parameters whose optimizer follows fp32 master weights.

The references are independent of the code under test: ``torch.optim.AdamW`` (single-tensor, CPU) on float32 copies
of the same parameters and gradients (fp32 master weights), torch's own float32 -> bf16 rounding, and the same AdamW on
bf16 parameters (what the low bits fix: the control that shows these tests can fail). The Triton kernel runs on CPU
in Triton's interpreter (``TRITON_INTERPRET=1``) against the module's torch path; on a GPU it runs compiled.
"""

import importlib
import os

import pytest
import torch


def fresh_module():
    import compensated_adamw

    return importlib.reload(compensated_adamw)  # the kernel is decorated on first use: honour TRITON_INTERPRET


def bf16_parameters(seed: int = 0, shapes=((33, 17), (5,), (3000,))) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).bfloat16()) for shape in shapes]


def gradients(params, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    # A common direction plus noise: the weights drift steadily, by less than a bf16 step per update at small lr.
    # Rounded to bf16 for every optimizer, so that the runs differ only in how they update the weights.
    return [(0.5 + torch.randn(p.shape, generator=generator)).bfloat16().to(p.dtype) for p in params]


def train(optimizer_class, params, steps: int, lr: float, **kwargs):
    optimizer = optimizer_class(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01, **kwargs)
    for step in range(steps):
        for param, grad in zip(params, gradients(params, step)):
            param.grad = grad
        optimizer.step()
    return optimizer


def master_weights(module, optimizer, param) -> torch.Tensor:
    return module.join_master(param.detach(), optimizer.state[param]["compensation"])


def test_split_and_join_are_exact_and_round_to_nearest():
    module = fresh_module()
    generator = torch.Generator().manual_seed(0)
    values = torch.cat(
        [
            torch.randn(10_000, generator=generator) * 10.0 ** torch.randint(-30, 30, (10_000,), generator=generator),
            torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-126, 3.4e38, -3.4e38, 1e-40]),
            torch.randn(1000, generator=generator).bfloat16().float(),  # exactly on bf16 values: low half 0
        ]
    )
    param, low = module.split_master(values)
    assert param.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(module.join_master(param, low).view(torch.int32), values.view(torch.int32))  # bit for bit
    nearest = values.bfloat16()  # torch rounds to nearest, ties to even; the split rounds ties away from zero
    tie = (values.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(param[~tie], nearest[~tie])
    assert (low[-1000:] == 0).all()


@pytest.mark.parametrize("lr", [1e-6, 1e-4])
def test_bf16_weights_follow_fp32_master_weights(lr):
    """With the moments in float32 too, the master weights are torch's fp32 AdamW's to float32 rounding; plain AdamW
    loses 28% (lr 1e-4) to 99% (lr 1e-6) of how far fp32 AdamW moves the weights in 200 steps."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    plain = bf16_parameters()
    compensated = bf16_parameters()
    train(torch.optim.AdamW, master, 200, lr, foreach=False)
    train(torch.optim.AdamW, plain, 200, lr)
    optimizer = train(
        module.CompensatedAdamW, compensated, 200, lr, state_dtype=torch.float32, initial_compensation="zero"
    )

    for index, (m, p, c, s) in enumerate(zip(master, plain, compensated, bf16_parameters())):
        moved = (m.detach() - s.float()).abs().mean()
        # To float32 rounding (torch's CPU kernels fuse some multiply-adds): a 1e-4 of the distance moved, or less.
        error = (master_weights(module, optimizer, c) - m.detach()).abs()
        assert error.max() < 1e-4 * moved, (index, error.max(), moved)
        torch.testing.assert_close(c.detach(), m.detach().bfloat16(), rtol=2**-7, atol=0)  # what autocast would use
        plain_error = (p.detach().float() - m.detach()).abs().mean()
        assert plain_error > 0.2 * moved, (index, plain_error, moved)  # the control: plain bf16 falls behind


def test_bf16_moments_stay_close_to_fp32_master_weights():
    """The default keeps the moments in bf16 (as torch does for bf16 parameters): close, not exact."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    compensated = bf16_parameters()
    train(torch.optim.AdamW, master, 200, 1e-5, foreach=False)
    optimizer = train(module.CompensatedAdamW, compensated, 200, 1e-5, initial_compensation="zero")
    for m, c, s in zip(master, compensated, bf16_parameters()):
        assert optimizer.state[c]["exp_avg"].dtype == torch.bfloat16
        moved = (m.detach() - s.float()).abs().mean()
        assert (master_weights(module, optimizer, c) - m.detach()).abs().mean() < 0.01 * moved


def test_dithered_low_bits_let_the_bf16_weights_follow_updates_below_one_bf16_step():
    """A float32 initialisation leaves each weight somewhere between two bf16 values, so tiny updates flip a share
    of the bf16 weights in proportion to their size: on average the bf16 weights move as far as the float32 ones.
    Random low bits reproduce that; zero low bits hold most weights still (the gap seen on ESM-2 650M)."""
    module = fresh_module()
    init = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    steps, lr = 20, 1e-6  # 2e-5 in all: a sixth of a bf16 step at 0.02

    def bf16_weights_after(optimizer_class, param, **kwargs):
        optimizer = optimizer_class([param], lr=lr, betas=(0.9, 0.98), weight_decay=0.0, **kwargs)
        for _ in range(steps):
            param.grad = torch.ones_like(param)  # Adam's update is then -lr every step
            optimizer.step()
        return param.detach().bfloat16().float()

    start = init.bfloat16().float()
    fp32 = (bf16_weights_after(torch.optim.AdamW, torch.nn.Parameter(init.clone())) - start).mean()
    dither = bf16_weights_after(module.CompensatedAdamW, torch.nn.Parameter(init.bfloat16()))
    zero = bf16_weights_after(
        module.CompensatedAdamW, torch.nn.Parameter(init.bfloat16()), initial_compensation="zero"
    )
    assert float(fp32) == pytest.approx(-steps * lr, rel=0.05)
    assert float((dither - start).mean()) == pytest.approx(float(fp32), rel=0.1)
    assert (zero - start).mean() > 0.5 * fp32  # moved less than half as far


def test_dither_fills_matrices_only_and_changes_no_weight():
    """torch.distributed.checkpoint creates optimizer state by stepping at lr 0: that must not move the weights."""
    module = fresh_module()
    params = bf16_parameters()
    with torch.no_grad():
        params[0][0, :5] = 0.0  # zeros keep a zero low half (a negative one would flip the sign)
    before = [p.detach().clone() for p in params]
    optimizer = train(module.CompensatedAdamW, params, 3, 0.0)
    for a, b in zip(before, params):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    matrix, vector = (optimizer.state[p]["compensation"].float() for p in params[:2])
    assert (matrix[0, :5] == 0).all() and (vector == 0).all()
    assert matrix.abs().mean() > 2**13 and abs(matrix.mean()) < 2**11  # uniform over [-2**15, 2**15): mean |x| 2**14


def test_state_dict_round_trip_continues_the_same_run():
    """A checkpoint restores the low bits with the moments: the resumed run equals the uninterrupted one."""
    module = fresh_module()
    straight = bf16_parameters()
    train(module.CompensatedAdamW, straight, 20, 1e-5)

    first_half = bf16_parameters()
    optimizer = train(module.CompensatedAdamW, first_half, 10, 1e-5)
    saved = optimizer.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "compensation"}
    assert saved["state"][0]["compensation"].dtype == torch.int16
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first_half]
    restored = module.CompensatedAdamW(resumed, lr=1e-5, betas=(0.9, 0.98), weight_decay=0.01)
    restored.load_state_dict(saved)
    for step in range(10, 20):
        for param, grad in zip(resumed, gradients(resumed, step)):
            param.grad = grad
        restored.step()
    assert restored.state[resumed[0]]["compensation"].dtype == torch.int16  # not cast to the parameter's bf16
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_run_of_torchs_adamw_resumes_with_zero_low_bits():
    """Switching compensate_bf16_updates on when resuming: the moments carry over, the low bits start at zero."""
    module = fresh_module()
    params = bf16_parameters()
    saved = train(torch.optim.AdamW, params, 5, 1e-4).state_dict()
    optimizer = module.CompensatedAdamW(params, lr=1e-4, betas=(0.9, 0.98), weight_decay=0.01)
    optimizer.load_state_dict(saved)
    before = params[0].detach().clone()
    for param, grad in zip(params, gradients(params, 5)):
        param.grad = grad
    optimizer.step()
    state = optimizer.state[params[0]]
    assert state["step"].item() == 6 and state["compensation"].dtype == torch.int16
    master = master_weights(module, optimizer, params[0])
    assert 0 < (master - before.float()).abs().max() < 1e-3  # one small step from the trained bf16 weights


def test_float32_parameters_get_plain_adamw():
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    ours = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    train(torch.optim.AdamW, master, 20, 1e-3, foreach=False)
    optimizer = train(module.CompensatedAdamW, ours, 20, 1e-3)
    assert "compensation" not in optimizer.state[ours[0]]
    for a, b in zip(master, ours):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def clip_factors(steps: int) -> list[float]:
    """A clipping factor per step, in [0.05, 1]: AdamW's update hardly changes when every gradient is scaled by the
    same factor (the moments scale with it), so the factors change from step to step."""
    generator = torch.Generator().manual_seed(7)
    return [
        1.0 if step % 4 == 3 else 0.05 + 0.95 * torch.rand((), generator=generator).item() for step in range(steps)
    ]


def test_grad_scale_steps_on_the_scaled_gradients_and_leaves_them_unchanged():
    """``step(grad_scale=c)`` (gradient clipping's factor, handed over as a tensor) follows torch's fp32 AdamW fed the
    float32 gradients times ``c`` to float32 rounding, and does not write ``.grad``; the control, the same steps
    without the factors, ends far off."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    scaled, unscaled = bf16_parameters(), bf16_parameters()
    kwargs = {"lr": 1e-4, "betas": (0.9, 0.98), "weight_decay": 0.01}
    reference = torch.optim.AdamW(master, **kwargs, foreach=False)
    optimizers = [
        module.CompensatedAdamW(params, **kwargs, state_dtype=torch.float32, initial_compensation="zero")
        for params in (scaled, unscaled)
    ]
    for step, factor in enumerate(clip_factors(20)):
        grads = gradients(scaled, step)
        for m, a, b, g in zip(master, scaled, unscaled, grads):
            m.grad = g.float() * factor
            a.grad, b.grad = g.clone(), g.clone()
        reference.step()
        optimizers[0].step(grad_scale=torch.tensor(factor))
        optimizers[1].step()
        for param, grad in zip(scaled, grads):
            torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)
    for index, (m, a, b, start) in enumerate(zip(master, scaled, unscaled, bf16_parameters())):
        moved = (m.detach() - start.float()).abs().mean()
        error = (master_weights(module, optimizers[0], a) - m.detach()).abs()
        assert error.max() < 1e-4 * moved, (index, error.max(), moved)
        control = (master_weights(module, optimizers[1], b) - m.detach()).abs().mean()
        assert control > 0.05 * moved, (index, control, moved)


def test_a_float_grad_scale_equals_a_tensor_and_bad_ones_are_refused():
    module = fresh_module()
    runs = []
    for grad_scale in (0.25, torch.tensor([0.25], dtype=torch.float64)):
        params = bf16_parameters()
        optimizer = module.CompensatedAdamW(params, lr=1e-4, initial_compensation="zero")
        for step in range(3):
            for param, grad in zip(params, gradients(params, step)):
                param.grad = grad
            optimizer.step(grad_scale=grad_scale if step == 1 else None)
        runs.append([master_weights(module, optimizer, p) for p in params])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for bad in (torch.ones(2), torch.ones((), dtype=torch.int32)):
        with pytest.raises(ValueError, match="grad_scale"):
            optimizer.step(grad_scale=bad)


def test_bad_arguments_are_refused():
    module = fresh_module()
    with pytest.raises(ValueError, match="lr"):
        module.CompensatedAdamW(bf16_parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        module.CompensatedAdamW(bf16_parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="initial_compensation"):
        module.CompensatedAdamW(bf16_parameters(), initial_compensation="random")
    with pytest.raises(TypeError, match="float16"):
        module.CompensatedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])


def kernel_inputs(numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(numel)
    param, grad, exp_avg, exp_avg_sq = (torch.randn(numel, generator=generator) for _ in range(4))
    tensors = [
        (param * 0.02).to(dtype),
        grad.to(dtype),
        (exp_avg * 0.1).to(dtype),
        (exp_avg_sq.square() * 0.01).to(dtype),
    ]
    low = torch.randint(-(2**15), 2**15, (numel,), generator=generator, dtype=torch.int32).to(torch.int16)
    return [*tensors, low if dtype == torch.bfloat16 else None]


def _off_by_one_element(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a view that starts one element into its buffer: not 16-byte aligned."""
    buffer = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    view = buffer[1:]
    view.copy_(tensor)
    return view


def kernel_equals_torch_path(module, device: str, aligned: bool = True, grad_scale: float | None = None) -> None:
    """The same arithmetic on the same inputs: the same master weights to float32 rounding (compiled, fused
    multiply-adds may round the last bit differently, and the interpreter, in numpy, differs from torch by one float32
    ulp in about 1 element of 200); bf16 moments within one bf16 step (the float32 -> bf16 conversion need not round
    as torch's does). ``aligned=False``: every array starts one element into its buffer, so the kernel must not
    assume 16-byte alignment. ``grad_scale``: both multiply the gradients by it (a one-element tensor)."""
    step = 7
    scalars = module.AdamWScalars(
        decay=1 - 4e-4 * 0.01,
        one_minus_beta1=1 - 0.9,
        beta2=0.98,
        one_minus_beta2=1 - 0.98,
        step_size=4e-4 / (1 - 0.9**step),
        sqrt_bias_correction2=(1 - 0.98**step) ** 0.5,
        eps=1e-8,
    )
    for dtype in (torch.float32, torch.bfloat16):
        # less than, exactly and more than one block of the kernel, all in one launch (a multi-tensor kernel): the
        # whole blocks run unmasked where the arrays are aligned, the partial ones masked
        block = module._BLOCK
        numels = (1, block - 1, block, 4 * block + 904)
        inputs = [kernel_inputs(numel, dtype) for numel in numels]
        # copies: on the CPU ``.to("cpu")`` returns the tensor itself, and the torch path then updated the kernel's
        # output in place and compared it with itself (how this test read the interpreter as exact until 2026-12-01)
        on_device = [[None if t is None else t.clone().to(device) for t in tensors] for tensors in inputs]
        if not aligned:
            on_device = [[None if t is None else _off_by_one_element(t) for t in tensors] for tensors in on_device]
            assert all(t.data_ptr() % 16 for tensors in on_device for t in tensors if t is not None)
        scale = None if grad_scale is None else torch.tensor(grad_scale)
        module.update_many_with_triton(
            [tuple(tensors) for tensors in on_device],
            scalars,
            module._BlockTables(),
            None if scale is None else scale.to(device),
        )
        for numel, by_torch, by_kernel in zip(numels, inputs, on_device):
            module.update_with_torch(*by_torch, scalars, scale)
            by_kernel = [None if t is None else t.cpu() for t in by_kernel]
            where = f"{dtype}, {numel} elements"
            if dtype == torch.bfloat16:
                master_kernel = module.join_master(by_kernel[0], by_kernel[4])
                master_torch = module.join_master(by_torch[0], by_torch[4])
            else:
                master_kernel, master_torch = by_kernel[0], by_torch[0]
            torch.testing.assert_close(
                master_kernel, master_torch, rtol=1e-6, atol=1e-9, msg=f"master weights, {where}"
            )
            torch.testing.assert_close(by_kernel[1], by_torch[1], rtol=0, atol=0)  # the gradient is only read
            moments = {"rtol": 2**-7, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-8}
            for name, a, b in zip(("exp_avg", "exp_avg_sq"), by_kernel[2:4], by_torch[2:4]):
                torch.testing.assert_close(a, b, **moments, msg=lambda m, n=name, w=where: f"{n}, {w}: {m}")


def test_triton_kernel_equals_the_torch_path_in_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = fresh_module()
    kernel_equals_torch_path(module, "cpu")
    kernel_equals_torch_path(module, "cpu", aligned=False)
    kernel_equals_torch_path(module, "cpu", grad_scale=0.37)


@pytest.mark.requires_gpu
def test_triton_kernel_equals_the_torch_path_on_the_gpu():
    module = fresh_module()
    assert os.environ.get("TRITON_INTERPRET") != "1"
    kernel_equals_torch_path(module, "cuda")
    kernel_equals_torch_path(module, "cuda", aligned=False)  # the kernel without alignment hints
    kernel_equals_torch_path(module, "cuda", grad_scale=0.37)
    kernel_equals_torch_path(module, "cuda", aligned=False, grad_scale=0.37)


def aligned_and_unaligned_launches_agree(module, device: str) -> None:
    """The vectorised launch (aligned arrays: whole blocks unmasked) and the element-wise one (every array one element
    into its buffer: all blocks masked) write the same bits: the arithmetic is the same, only the loads differ."""
    scalars = module.AdamWScalars(
        decay=1 - 1e-5,
        one_minus_beta1=0.1,
        beta2=0.98,
        one_minus_beta2=0.02,
        step_size=3e-4,
        sqrt_bias_correction2=0.3,
        eps=1e-8,
    )
    numels = (module._BLOCK - 3, 3 * module._BLOCK + 17)
    results = []
    for shift in (False, True):
        tensors = [
            [None if t is None else t.to(device) for t in kernel_inputs(numel, torch.bfloat16)] for numel in numels
        ]
        if shift:
            tensors = [[None if t is None else _off_by_one_element(t) for t in row] for row in tensors]
        assert all((t.data_ptr() % 16 != 0) is shift for row in tensors for t in row)
        module.update_many_with_triton([tuple(row) for row in tensors], scalars, module._BlockTables())
        results.append([t.cpu() for row in tensors for t in row])
    for aligned, unaligned in zip(*results):
        torch.testing.assert_close(unaligned, aligned, rtol=0, atol=0)


def test_aligned_and_unaligned_launches_agree_in_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    aligned_and_unaligned_launches_agree(fresh_module(), "cpu")


@pytest.mark.requires_gpu
def test_aligned_and_unaligned_launches_agree_on_the_gpu():
    module = fresh_module()
    assert os.environ.get("TRITON_INTERPRET") != "1"
    aligned_and_unaligned_launches_agree(module, "cuda")


@pytest.mark.requires_gpu
def test_a_step_on_the_gpu_equals_the_torch_path_on_the_cpu():
    """``step`` on CUDA (bf16 and float32 parameters in two groups with their own settings, one launch per dtype
    mix, a tensor too small to fill a block, a non-contiguous one through the torch path) against the same optimizer
    on CPU (the torch path for every tensor): the same master weights and moments to float32 rounding. The moments
    are float32 here: in bf16 a last-bit difference of the compiled arithmetic can flip a moment's rounding and move
    the next update by 2^-8 of itself (the per-element arithmetic in bf16 is checked against the torch path above)."""
    module = fresh_module()
    shapes = ((33, 17), (5,), (3000,), (2048,))
    runs = {}
    for device in ("cpu", "cuda"):
        bf16 = [torch.nn.Parameter(p.detach().to(device)) for p in bf16_parameters(shapes=shapes)]
        fp32 = [torch.nn.Parameter(p.detach().float().to(device)) for p in bf16_parameters(seed=1, shapes=shapes)]
        strided = torch.nn.Parameter(torch.zeros(8, 6, device=device, dtype=torch.bfloat16).t())
        groups = [{"params": [*bf16, strided]}, {"params": fp32, "weight_decay": 0.0, "lr": 3e-4}]
        # low bits from zero: the dither's random numbers differ between a CPU and a CUDA generator
        optimizer = module.CompensatedAdamW(
            groups,
            lr=1e-4,
            betas=(0.9, 0.98),
            weight_decay=0.01,
            initial_compensation="zero",
            state_dtype=torch.float32,
        )
        params = [*bf16, strided, *fp32]
        for step in range(5):
            for param, grad in zip(params, gradients(params, step)):
                param.grad = grad.to(device)
            optimizer.step()
        runs[device] = (optimizer, params)
    (cpu_optimizer, cpu_params), (gpu_optimizer, gpu_params) = runs["cpu"], runs["cuda"]
    for index, (on_cpu, on_gpu) in enumerate(zip(cpu_params, gpu_params)):
        cpu_state, gpu_state = cpu_optimizer.state[on_cpu], gpu_optimizer.state[on_gpu]
        expected, actual = on_cpu.detach().float(), on_gpu.detach().float().cpu()
        if "compensation" in cpu_state:
            expected = module.join_master(on_cpu.detach(), cpu_state["compensation"])
            actual = module.join_master(on_gpu.detach().cpu(), gpu_state["compensation"].cpu())
        assert int(gpu_state["step"]) == 5
        torch.testing.assert_close(
            actual, expected, rtol=1e-6, atol=1e-9, msg=lambda m, i=index: f"parameter {i}: {m}"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            # atol: a moment near zero is a sum of O(1) terms that cancel, so its rounding error is that of its
            # terms: a few float32 ulps of the largest moment (an H200 showed 3.7e-8 at gradients of O(1); a wrong
            # update would be off by a percent of the moment)
            torch.testing.assert_close(
                gpu_state[key].cpu(),
                cpu_state[key],
                rtol=1e-6,
                atol=4 * torch.finfo(torch.float32).eps * cpu_state[key].abs().max().item(),
                msg=lambda m, k=key, i=index: f"{k} {i}: {m}",
            )


@pytest.mark.requires_gpu
def test_bf16_weights_follow_fp32_master_weights_on_the_gpu():
    """The whole optimizer on CUDA (the Triton path) against torch's fused fp32 AdamW."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float().cuda()) for p in bf16_parameters()]
    compensated = [torch.nn.Parameter(p.detach().cuda()) for p in bf16_parameters()]
    optimizers = []
    for optimizer_class, params, kwargs in (
        (torch.optim.AdamW, master, {"fused": True}),
        (module.CompensatedAdamW, compensated, {"state_dtype": torch.float32, "initial_compensation": "zero"}),
    ):
        optimizers.append(optimizer_class(params, lr=1e-6, betas=(0.9, 0.98), weight_decay=0.01, **kwargs))
        for step in range(200):
            for param, grad in zip(params, gradients(params, step)):
                param.grad = grad.cuda()
            optimizers[-1].step()
    for m, c, s in zip(master, compensated, bf16_parameters()):
        moved = (m.detach().cpu() - s.float()).abs().mean()
        error = (master_weights(module, optimizers[1], c) - m.detach()).abs().cpu()
        assert error.mean() < 1e-3 * moved and error.max() < 1e-2 * moved, (error.mean(), error.max(), moved)


def float32_init(seed: int = 0, shapes=((33, 17), (5,), (3000,))) -> list[torch.Tensor]:
    """float32 weights with all their low bits in use (not on bf16 values), as a float32 initialisation leaves them."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 0.02 for shape in shapes]


def test_split_float32_masters_makes_the_model_bf16_and_keeps_every_float32_weight():
    module = fresh_module()
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.LayerNorm(17))
    model.register_buffer("table", torch.randn(5))
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    low_bits = module.split_float32_masters(model)
    assert model.table.dtype == torch.bfloat16  # buffers as model.to(torch.bfloat16) casts them
    assert set(low_bits) == set(model.parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and param.requires_grad
        assert torch.equal(
            module.join_master(param.detach(), low_bits[param]).view(torch.int32), weights[name].view(torch.int32)
        )
        split = module.split_master(weights[name])[0]
        assert torch.equal(param.detach().view(torch.int16), split.view(torch.int16))  # the split's rounding


@pytest.mark.parametrize("lr", [1e-6, 1e-4])
def test_given_low_bits_run_fp32_adamw_on_the_float32_init(lr):
    """Starting from the split of a float32 init (``masters_in_optimizer``), with float32 moments, the masters are
    torch's fp32 AdamW's from that same init, to float32 rounding; the control, dithered low bits, is not."""
    module = fresh_module()
    master = [torch.nn.Parameter(t.clone()) for t in float32_init()]
    model = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in float32_init()])
    low_bits = module.split_float32_masters(model)
    dithered = [torch.nn.Parameter(p.detach().clone()) for p in model]
    train(torch.optim.AdamW, master, 200, lr, foreach=False)
    optimizer = train(
        module.CompensatedAdamW, list(model), 200, lr, state_dtype=torch.float32, initial_compensation=low_bits
    )
    control = train(module.CompensatedAdamW, dithered, 200, lr, state_dtype=torch.float32)
    assert not low_bits  # taken over by the optimizer, each when its state was made

    for index, (m, c, d, init) in enumerate(zip(master, model, dithered, float32_init())):
        moved = (m.detach() - init).abs().mean()
        error = (master_weights(module, optimizer, c) - m.detach()).abs()
        assert error.max() < 1e-4 * moved, (index, error.max(), moved)
        if init.dim() >= 2:  # dithered low bits: matrices start off their float32 init by up to half a bf16 step
            control_error = (master_weights(module, control, d) - m.detach()).abs().max()
            assert control_error > 100 * error.max(), (index, control_error, error.max())


def test_master_state_dict_holds_the_float32_masters():
    """Stepped parameters give their joined masters, not yet stepped ones their given low bits, under every name of
    a tied weight; parameters without low bits and buffers stay as they are."""
    module = fresh_module()

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(7, 4)
            self.head = torch.nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(4)
            self.register_buffer("table", torch.arange(3.0))

    model = Tied()
    init = {name: value.clone() for name, value in model.state_dict().items()}
    low_bits = module.split_float32_masters(model)
    optimizer = module.CompensatedAdamW(
        [model.embed.weight, model.norm.weight], lr=1e-3, state_dtype=torch.float32, initial_compensation=low_bits
    )
    state = module.master_state_dict(model, optimizer)  # before any step: the float32 init
    for name in ("embed.weight", "head.weight", "norm.weight"):
        assert state[name].dtype == torch.float32 and torch.equal(state[name], init[name]), name
    assert state["norm.bias"].dtype == torch.float32  # not the optimizer's, but its low bits were given
    model.extra = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))  # no low bits anywhere
    state = module.master_state_dict(model, optimizer)
    assert state["extra"].dtype == torch.bfloat16
    assert torch.equal(state["table"], init["table"].bfloat16())

    model.embed.weight.grad = torch.ones_like(model.embed.weight)
    model.norm.weight.grad = torch.ones_like(model.norm.weight)
    optimizer.step()
    state = module.master_state_dict(model, optimizer)
    stepped = master_weights(module, optimizer, model.embed.weight)
    assert torch.equal(state["embed.weight"], stepped) and torch.equal(state["head.weight"], stepped)
    assert not torch.equal(stepped, init["embed.weight"])
