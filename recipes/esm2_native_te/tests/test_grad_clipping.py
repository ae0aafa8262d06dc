# Copied from common/tests/test_grad_clipping.py — edit the source, then run ci/check_copies.py --fix
"""grad_clipping.clip_sharded_grad_norm_ on two CPU processes (gloo), with the gradient layout Megatron-FSDP leaves:
DTensor gradients sharded over the data-parallel ranks, and None on a rank that holds no part of a parameter.

The reference is independent of the code under test: the full gradients, known to both processes, their global norm
by ``torch.linalg.vector_norm``, and the clipped gradients as that norm scales them.
"""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from grad_clipping import clip_sharded_grad_norm_
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
