"""compensated_adamw.CompensatedAdamW: bf16 parameters that learn as fp32 ones do, checked against torch's AdamW.

The references are independent of the code under test: ``torch.optim.AdamW`` on float32 copies of the same
parameters and gradients (fp32 master weights), and the same AdamW on bf16 parameters (what the compensation fixes).
The Triton kernel runs on CPU in Triton's interpreter (``TRITON_INTERPRET=1``) against the module's torch path; on a
GPU it runs compiled.
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


def train(optimizer_class, params, steps: int, lr: float, **kwargs) -> None:
    optimizer = optimizer_class(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01, **kwargs)
    for step in range(steps):
        for param, grad in zip(params, gradients(params, step)):
            param.grad = grad.to(param.dtype)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-4])
def test_bf16_weights_follow_fp32_master_weights(lr):
    """Plain bf16 AdamW loses 28% (lr 1e-4) to 99% (lr 1e-6) of how far fp32 AdamW moves the weights in 200 steps;
    the compensated bf16 weights (moments in fp32, as the master run's) stay within 2% of it on average."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    plain = bf16_parameters()
    compensated = bf16_parameters()
    train(torch.optim.AdamW, master, 200, lr)
    train(torch.optim.AdamW, plain, 200, lr)
    optimizer = train(module.CompensatedAdamW, compensated, 200, lr, state_dtype=torch.float32)

    for index, (m, p, c, s) in enumerate(zip(master, plain, compensated, bf16_parameters())):
        moved = (m.detach() - s.float()).abs().mean()
        value = c.detach().float() + optimizer.state[c]["compensation"].float()
        error = (value - m.detach()).abs()
        assert error.mean() < 0.02 * moved and error.max() < 0.1 * moved, (index, error.mean(), error.max(), moved)
        # The parameter itself is the bf16 rounding of that value: within one bf16 step of fp32 AdamW's weight.
        assert ((c.detach().float() - m.detach()).abs() <= 2**-8 * m.detach().abs() + error).all()
        plain_error = (p.detach().float() - m.detach()).abs().mean()
        assert plain_error > 0.2 * moved, (index, plain_error, moved)  # the control: plain bf16 falls behind


def test_bf16_moments_stay_close_to_fp32_master_weights():
    """The default keeps the moments in bf16 (as torch does for bf16 parameters): close, not exact."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float()) for p in bf16_parameters()]
    compensated = bf16_parameters()
    train(torch.optim.AdamW, master, 200, 1e-5)
    optimizer = train(module.CompensatedAdamW, compensated, 200, 1e-5)
    for m, c, s in zip(master, compensated, bf16_parameters()):
        assert optimizer.state[c]["exp_avg"].dtype == torch.bfloat16
        moved = (m.detach() - s.float()).abs().mean()
        value = c.detach().float() + optimizer.state[c]["compensation"].float()
        assert (value - m.detach()).abs().mean() < 0.02 * moved


def test_state_dict_round_trip_continues_the_same_run():
    """A checkpoint restores the compensation with the moments: the resumed run equals the uninterrupted one."""
    module = fresh_module()
    straight = bf16_parameters()
    train(module.CompensatedAdamW, straight, 20, 1e-5)

    first_half = bf16_parameters()
    optimizer = train(module.CompensatedAdamW, first_half, 10, 1e-5)
    saved = optimizer.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "compensation"}
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first_half]
    restored = module.CompensatedAdamW(resumed, lr=1e-5, betas=(0.9, 0.98), weight_decay=0.01)
    restored.load_state_dict(saved)
    for step in range(10, 20):
        for param, grad in zip(resumed, gradients(resumed, step)):
            param.grad = grad
        restored.step()
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_learning_rate_changes_no_parameter():
    """torch.distributed.checkpoint creates optimizer state by stepping at lr 0: that must not move the weights."""
    module = fresh_module()
    params = bf16_parameters()
    before = [p.detach().clone() for p in params]
    train(module.CompensatedAdamW, params, 3, 0.0)
    for a, b in zip(before, params):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_bad_hyperparameters_are_refused():
    module = fresh_module()
    with pytest.raises(ValueError, match="lr"):
        module.CompensatedAdamW(bf16_parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        module.CompensatedAdamW(bf16_parameters(), betas=(0.9, 1.0))


def kernel_inputs(numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(numel)
    param, grad, exp_avg, exp_avg_sq, compensation = (torch.randn(numel, generator=generator) for _ in range(5))
    values = [param * 0.02, grad, exp_avg * 0.1, exp_avg_sq.square() * 0.01, compensation * 1e-6]
    return [v.to(dtype) for v in values]


def kernel_equals_torch_path(module, device: str, exact_in_float32: bool) -> None:
    """float32 tensors: the same arithmetic, so the same bits (or, compiled, within fused multiply-add rounding).
    bf16 tensors: the weight each pair ``param + compensation`` stands for agrees to ~16 bits, the moments to one
    bf16 step (the interpreter's float32 -> bf16 conversion need not round as the GPU's does)."""
    step = 7
    scalars = module.AdamWScalars(
        decay=1 - 4e-4 * 0.01,
        beta1=0.9,
        beta2=0.98,
        step_size=4e-4 / (1 - 0.9**step),
        inv_sqrt_bias_correction2=1 / (1 - 0.98**step) ** 0.5,
        eps=1e-8,
    )
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "compensation")
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 2047, 2048, 5000):  # less than, exactly and more than one block of the kernel
            by_torch = kernel_inputs(numel, dtype)
            by_kernel = [t.to(device) for t in by_torch]
            module._update_with_triton(*by_kernel, scalars)
            module.update_with_torch(*by_torch, scalars)
            by_kernel = [t.cpu() for t in by_kernel]
            where = f"{dtype}, {numel} elements"
            if dtype == torch.float32:
                tolerance = {"rtol": 0, "atol": 0} if exact_in_float32 else {"rtol": 1e-6, "atol": 1e-9}
                for name, a, b in zip(names, by_kernel, by_torch):
                    torch.testing.assert_close(a, b, **tolerance, msg=lambda m, n=name, w=where: f"{n}, {w}: {m}")
                continue
            torch.testing.assert_close(by_kernel[1], by_torch[1], rtol=0, atol=0)  # the gradient is only read
            value_kernel = by_kernel[0].float() + by_kernel[4].float()
            value_torch = by_torch[0].float() + by_torch[4].float()
            torch.testing.assert_close(value_kernel, value_torch, rtol=2**-14, atol=1e-9, msg=where)
            for name, a, b in zip(names[2:4], by_kernel[2:4], by_torch[2:4]):
                torch.testing.assert_close(a, b, rtol=2**-7, atol=0, msg=lambda m, n=name, w=where: f"{n}, {w}: {m}")


def test_triton_kernel_equals_the_torch_path_in_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = fresh_module()
    kernel_equals_torch_path(module, "cpu", exact_in_float32=True)


@pytest.mark.requires_gpu
def test_triton_kernel_equals_the_torch_path_on_the_gpu():
    module = fresh_module()
    assert os.environ.get("TRITON_INTERPRET") != "1"
    kernel_equals_torch_path(module, "cuda", exact_in_float32=False)


@pytest.mark.requires_gpu
def test_bf16_weights_follow_fp32_master_weights_on_the_gpu():
    """The whole optimizer on CUDA (the Triton path) against fp32 AdamW, as on CPU."""
    module = fresh_module()
    master = [torch.nn.Parameter(p.detach().float().cuda()) for p in bf16_parameters()]
    compensated = [torch.nn.Parameter(p.detach().cuda()) for p in bf16_parameters()]
    for optimizer_class, params, kwargs in (
        (torch.optim.AdamW, master, {"fused": True}),
        (module.CompensatedAdamW, compensated, {"state_dtype": torch.float32}),
    ):
        optimizer = optimizer_class(params, lr=1e-6, betas=(0.9, 0.98), weight_decay=0.01, **kwargs)
        for step in range(200):
            for param, grad in zip(params, gradients(params, step)):
                param.grad = grad.cuda().to(param.dtype)
            optimizer.step()
    start = bf16_parameters()
    for m, c, s in zip(master, compensated, start):
        moved = (m.detach().cpu() - s.float()).abs().mean()
        value = (c.detach().float() + optimizer.state[c]["compensation"].float()).cpu()
        assert (value - m.detach().cpu()).abs().max() < 1e-3 * moved
