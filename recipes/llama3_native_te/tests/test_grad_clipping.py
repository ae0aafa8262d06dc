# Copied from common/tests/test_grad_clipping.py — edit the source, then run ci/check_copies.py --fix
"""grad_clipping: ``clip_sharded_grad_norm_`` on two CPU processes (gloo), with the gradient layout Megatron-FSDP
leaves (DTensor gradients sharded over the data-parallel ranks, and None on a rank that holds no part of a parameter),
and ``clip_grad_norm_and_step`` on one.

The references are independent of the code under test: the full gradients, known to both processes, their global norm
by ``torch.linalg.vector_norm``, and the clipped gradients as that norm scales them; for the clip-and-step, torch's
``clip_grad_norm_`` followed by the optimizer's plain step, and torch's AdamW (fused on the GPU) for fp32 weights.
"""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from grad_clipping import clip_grad_norm_and_step, clip_sharded_grad_norm_
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def full_gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # (1, 4) is sharded 1 row / 0 rows: rank 1 holds nothing of it, as Megatron-FSDP's small parameters.
    return [torch.randn(shape, generator=generator) for shape in ((6, 4), (1, 4), (3,), (5,))]


def clip_on_two_ranks(rank: int, store: str, max_norm: float | None, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        params = []
        for index, grad in enumerate(full_gradients()):
            if index < 3:  # sharded over dp (the (3,) vector unevenly: 2 + 1)
                param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, [Shard(0)]))
                param.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
                if param.grad.to_local().numel() == 0:
                    param.grad = None  # what Megatron-FSDP leaves on a rank without a piece
            else:  # a plain, replicated parameter
                param = torch.nn.Parameter(torch.zeros_like(grad))
                param.grad = grad.clone()
            params.append(param)
        norm = clip_sharded_grad_norm_(params, max_norm)
        pieces = [
            None if p.grad is None else (p.grad.to_local() if index < 3 else p.grad) for index, p in enumerate(params)
        ]
        results[rank] = (norm.item(), pieces)
    finally:
        dist.destroy_process_group()


def run_on_two_ranks(tmp_path, max_norm):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(clip_on_two_ranks, args=(str(tmp_path / "store"), max_norm, results), nprocs=2, join=True)
        return dict(results)


def test_global_norm_and_clipping_with_a_rank_holding_no_part_of_a_parameter(tmp_path):
    full = full_gradients()
    expected_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full])).item()
    max_norm = expected_norm / 4
    results = run_on_two_ranks(tmp_path, max_norm)
    scale = max_norm / (expected_norm + 1e-6)
    for rank in (0, 1):
        norm, pieces = results[rank]
        assert abs(norm - expected_norm) < 1e-5 * expected_norm, (rank, norm, expected_norm)
        assert (pieces[1] is None) == (rank == 1)
        rows = {0: (slice(0, 3), slice(0, 1), slice(0, 2)), 1: (slice(3, 6), None, slice(2, 3))}[rank]
        for index, grad in enumerate(full):
            want = grad * scale if index == 3 else (None if rows[index] is None else grad[rows[index]] * scale)
            if want is None:
                continue
            torch.testing.assert_close(pieces[index], want, msg=f"rank {rank}, gradient {index}")


def test_measures_without_clipping(tmp_path):
    full = full_gradients()
    expected_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full])).item()
    results = run_on_two_ranks(tmp_path, None)
    norm, pieces = results[0]
    assert abs(norm - expected_norm) < 1e-5 * expected_norm
    torch.testing.assert_close(pieces[3], full[3], rtol=0, atol=0)  # untouched


def test_bf16_gradients_norms_are_float32():
    """Megatron-FSDP with bf16 weights hands bf16 gradients: each tensor's norm is taken in float32, not rounded to
    bf16 first (sqrt(3) is 1.7320508 in float32 and 1.734375 in bf16)."""
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2)]
    for param in params:
        param.grad = torch.ones(3, dtype=torch.bfloat16)
    norm = clip_sharded_grad_norm_(params, None)
    assert norm.dtype == torch.float32
    assert norm.item() == torch.tensor(6.0).sqrt().item()  # sqrt(3 + 3)


def varying_gradients(params, step: int) -> list[torch.Tensor]:
    """Gradients whose global norm changes from step to step (0.1 to 100 times that of N(0, 1) noise), so that some
    steps clip at ``max_norm`` 5 and some do not, by varying factors (AdamW hardly feels a constant one)."""
    generator = torch.Generator().manual_seed(100 + step)
    size = (0.1, 3.0, 100.0, 0.5, 20.0)[step % 5]
    return [(torch.randn(p.shape, generator=generator) * size).to(p.dtype) for p in params]


def parameters(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=generator) * 0.02).to(dtype)) for s in ((17, 9), (9,), (40,))]


def global_norm(grads: list[torch.Tensor], float32: bool = False) -> float:
    """The gradients' L2 norm as one vector, by ``torch.linalg.vector_norm``: in float32 (as the sharded norm takes
    it), or as torch's ``clip_grad_norm_`` does for bf16 gradients, each tensor's norm rounded to bf16 first."""
    if float32:
        return torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads])).item()
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    return torch.linalg.vector_norm(norms).item()


def run_clip_and_step(optimizer_class, dtype, steps: int, max_norm, **kwargs):
    """(parameters, norms, gradients after each step) of ``clip_grad_norm_and_step`` over ``steps`` steps."""
    params = parameters(dtype)
    optimizer = optimizer_class(params, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01, **kwargs)
    norms, grads_after = [], []
    for step in range(steps):
        for param, grad in zip(params, varying_gradients(params, step)):
            param.grad = grad
        norms.append(clip_grad_norm_and_step(optimizer, params, max_norm))
        grads_after.append([param.grad.clone() for param in params])
    return params, norms, grads_after


def test_torchs_adamw_gets_torchs_in_place_clipping():
    """An optimizer without ``scales_gradients_in_step``: exactly ``clip_grad_norm_`` then ``step()``."""
    params, norms, grads_after = run_clip_and_step(torch.optim.AdamW, torch.float32, 5, 5.0, foreach=False)
    reference = parameters(torch.float32)
    optimizer = torch.optim.AdamW(reference, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01, foreach=False)
    for step in range(5):
        for param, grad in zip(reference, varying_gradients(reference, step)):
            param.grad = grad
        norm = torch.nn.utils.clip_grad_norm_(reference, 5.0)
        optimizer.step()
        assert norm.item() == norms[step].item()
        for param, grad in zip(reference, grads_after[step]):
            torch.testing.assert_close(grad, param.grad, rtol=0, atol=0)  # clipped in place, as torch does
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_compensated_adamw_gets_the_clip_factor_and_the_gradients_stay(sharded):
    """``CompensatedAdamW`` (bf16 weights): the step gets ``clip_factor`` of the norm torch's ``clip_grad_norm_``
    measures (``clip_sharded_grad_norm_``'s with ``sharded``), the gradients are not touched, and the weights end
    where in-place clipping takes them to within its bf16 rounding of the clipped gradients; the control, the same
    steps without clipping, ends far off."""
    compensated_adamw = importlib.import_module("compensated_adamw")
    kwargs = {"initial_compensation": "zero", "state_dtype": torch.float32}

    def run(clip: str):
        params = parameters(torch.bfloat16)
        optimizer = compensated_adamw.CompensatedAdamW(params, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01, **kwargs)
        for step in range(10):
            grads = varying_gradients(params, step)
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            if clip == "in step":
                norm = clip_grad_norm_and_step(optimizer, params, 5.0, sharded=sharded)
                assert norm.item() == pytest.approx(global_norm(grads, sharded), rel=1e-6)
                for param, grad in zip(params, grads):
                    torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)
            elif clip == "in place":
                torch.nn.utils.clip_grad_norm_(params, 5.0)
                optimizer.step()
            else:
                optimizer.step()
        return [compensated_adamw.join_master(p.detach(), optimizer.state[p]["compensation"]) for p in params]

    in_step, in_place, unclipped = run("in step"), run("in place"), run("none")
    for start, a, b, c in zip(parameters(torch.float32), in_step, in_place, unclipped):
        moved = (b - start).abs().mean()
        assert (a - b).abs().mean() < 0.01 * moved, ((a - b).abs().mean(), moved)
        assert (c - b).abs().mean() > 0.1 * moved, ((c - b).abs().mean(), moved)


def clip_in_place_and_step(optimizer, params, steps: int, max_norm: float, device: str = "cpu") -> None:
    """The reference loop: torch's ``clip_grad_norm_``, then the optimizer's plain ``step()``."""
    for step in range(steps):
        for param, grad in zip(params, varying_gradients(params, step)):
            param.grad = grad.to(device)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()


def test_compensated_adamw_with_fp32_weights_steps_as_in_place_clipping_does():
    """fp32 weights (``CompensatedAdamW``'s float32 path, the recipes' AdamW for fp32 master weights on CUDA): the
    factor applied in the step gives the float32 product that in-place clipping writes, so the weights are those of
    ``clip_grad_norm_`` + ``step()`` bit for bit, and torch's AdamW's to float32 rounding; the gradients stay
    unclipped. Every step but the first clips (by factors of 0.004 to 0.7)."""
    compensated_adamw = importlib.import_module("compensated_adamw")
    optimizer_kwargs = {"lr": 1e-3, "betas": (0.9, 0.98), "weight_decay": 0.01}
    params, norms, grads_after = run_clip_and_step(compensated_adamw.CompensatedAdamW, torch.float32, 5, 5.0)
    for step, grads in enumerate(grads_after):
        for grad, unclipped in zip(grads, varying_gradients(params, step)):
            torch.testing.assert_close(grad, unclipped, rtol=0, atol=0)
    assert [norm.item() > 5.0 for norm in norms] == [False, True, True, True, True]

    reference = parameters(torch.float32)
    optimizer = compensated_adamw.CompensatedAdamW(reference, **optimizer_kwargs)
    clip_in_place_and_step(optimizer, reference, 5, 5.0)
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    torchs = parameters(torch.float32)
    clip_in_place_and_step(torch.optim.AdamW(torchs, **optimizer_kwargs, foreach=False), torchs, 5, 5.0)
    for start, a, b in zip(parameters(torch.float32), params, torchs):
        moved = (b - start).abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * moved)


@pytest.mark.requires_gpu
def test_fp32_weights_on_the_gpu_step_as_torchs_fused_adamw_with_in_place_clipping():
    """The recipes' old and new fp32-weight step on CUDA: ``clip_grad_norm_and_step`` with ``CompensatedAdamW``'s
    Triton kernel against ``clip_grad_norm_`` + torch's fused AdamW, 20 steps of clipped and unclipped gradients: the
    same weights and moments to float32 rounding (the compiled kernels may fuse multiply-adds differently)."""
    compensated_adamw = importlib.import_module("compensated_adamw")
    optimizer_kwargs = {"lr": 1e-3, "betas": (0.9, 0.98), "weight_decay": 0.01}
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in parameters(torch.float32)]
    optimizer = compensated_adamw.CompensatedAdamW(ours, **optimizer_kwargs)
    for step in range(20):
        for param, grad in zip(ours, varying_gradients(ours, step)):
            param.grad = grad.cuda()
        clip_grad_norm_and_step(optimizer, ours, 5.0)
    torchs = [torch.nn.Parameter(p.detach().cuda()) for p in parameters(torch.float32)]
    fused = torch.optim.AdamW(torchs, **optimizer_kwargs, fused=True)
    clip_in_place_and_step(fused, torchs, 20, 5.0, device="cuda")
    for start, a, b in zip(parameters(torch.float32), ours, torchs):
        moved = (b.cpu() - start).abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * moved)
        for key in ("exp_avg", "exp_avg_sq"):
            want = fused.state[b][key]
            torch.testing.assert_close(optimizer.state[a][key], want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_max_norm_none_measures_and_steps():
    params, norms, grads_after = run_clip_and_step(torch.optim.AdamW, torch.float32, 3, None, foreach=False)
    for step in range(3):
        assert norms[step].item() == pytest.approx(global_norm(varying_gradients(params, step)), rel=1e-6)
        for grad, unclipped in zip(grads_after[step], varying_gradients(params, step)):
            torch.testing.assert_close(grad, unclipped, rtol=0, atol=0)
