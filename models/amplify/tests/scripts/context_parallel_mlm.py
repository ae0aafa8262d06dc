# Copied from common/tests/scripts/context_parallel_mlm.py — edit the source, then run ci/check_copies.py --fix
"""torchrun worker for masked language models: a packed batch split over context-parallel ranks gives the same
logits, loss and gradients as the whole batch in one process. Prints CP-OK on rank 0.

Arguments: backend and contract name. Backend ``te`` runs one GPU per rank in bf16; ``torch`` runs CPU processes on
gloo in float32. The contract (``CONTRACTS[name]`` in the model's tests/test_model_contract.py) gives the model
(its ``te_hf_model``, converted: a shape TE's fused attention takes) and the masked batch.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


# The package under test and tests/, whether or not the package is pip-installed (a GPU machine may run the tests
# from a checkout).
COMPONENT_DIR = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(COMPONENT_DIR), str(COMPONENT_DIR / "tests")]
from test_model_contract import CONTRACTS  # noqa: E402


def dual_chunk_positions(padded_cu: list[int], rank: int, cp_size: int) -> torch.Tensor:
    """Positions rank `rank` holds: chunks rank and 2*cp-1-rank of every padded sequence (TE's layout, written out
    here rather than taken from the code under test)."""
    pieces = []
    for start, end in zip(padded_cu[:-1], padded_cu[1:]):
        chunk = (end - start) // (2 * cp_size)
        for c in (rank, 2 * cp_size - 1 - rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces)


def main(backend: str, contract_name: str) -> None:
    on_gpu = backend == "te"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, cp_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    contract = CONTRACTS[contract_name]
    model = contract.hf_to_nv(contract.te_hf_model(), backend=backend)
    model = model.to(device, torch.bfloat16 if on_gpu else torch.float32)
    pad_token_id = model.config.pad_token_id
    tolerance = 2e-2 if on_gpu else 1e-4

    # The contract's masked batch, each sequence's real tokens padded to a multiple of 2 * cp_size and packed.
    batch = contract.make_batch([300, 123, 77], seed=1)
    real = batch["attention_mask"].bool()
    sequences = [(ids[keep], labels[keep]) for ids, labels, keep in zip(batch["input_ids"], batch["labels"], real)]
    input_ids, labels, padded_cu = [], [], [0]
    for ids, targets in sequences:
        padding = -len(ids) % (2 * cp_size)
        input_ids.append(torch.cat([ids, torch.full((padding,), pad_token_id)]))
        labels.append(torch.cat([targets, torch.full((padding,), -100)]))
        padded_cu.append(padded_cu[-1] + len(ids) + padding)
    input_ids, labels = torch.cat(input_ids), torch.cat(labels)
    max_length = max(end - start for start, end in zip(padded_cu[:-1], padded_cu[1:]))

    # Reference: the same padded batch (CP padding is part of each sequence) in one process, no context parallelism.
    cu = torch.tensor(padded_cu, dtype=torch.int32, device=device)
    lengths_kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_length, "max_length_k": max_length}
    reference = model(
        input_ids=input_ids.to(device).unsqueeze(0), labels=labels.to(device).unsqueeze(0), **lengths_kwargs
    )
    reference.loss.backward()
    reference_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    group = dist.new_group(list(range(cp_size)))
    model.base_model.set_context_parallel_group(group, list(range(cp_size)), torch.cuda.Stream() if on_gpu else None)
    local = dual_chunk_positions(padded_cu, rank, cp_size)
    cp_batch = {
        "input_ids": input_ids[local].to(device).unsqueeze(0),
        "labels": labels[local].to(device).unsqueeze(0),
        "cu_seq_lens_q_padded": cu,
        "cu_seq_lens_k_padded": cu,
        **lengths_kwargs,
    }
    out = model(**cp_batch)
    # Gradients: each rank's loss is its share of the CP group's mean, so the ranks' gradients sum to the whole
    # batch's (data parallelism over dp x cp ranks averages them, and the loss is scaled by cp_size for that).
    out.loss.backward()
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grad /= cp_size
        grad_error = (
            (grad.float() - reference_grads[name].float()).norm() / reference_grads[name].float().norm()
        ).item()
        assert grad_error < 5 * tolerance, f"{name}: CP gradient differs from the reference by {grad_error}"
    model.zero_grad()
    gathered = [torch.empty_like(out.logits) for _ in range(cp_size)]
    dist.all_gather(gathered, out.logits.contiguous())
    full = torch.empty(1, padded_cu[-1], out.logits.shape[-1], device=device, dtype=out.logits.dtype)
    for r, logits in enumerate(gathered):
        full[0, dual_chunk_positions(padded_cu, r, cp_size).to(device)] = logits
    error = ((full.float() - reference.logits.float()).norm() / reference.logits.float().norm()).item()
    assert error < tolerance, f"CP logits differ from the single-process reference: relative error {error}"
    assert abs(out.loss.item() - reference.loss.item()) < tolerance * reference.loss.item(), (out.loss, reference.loss)

    # A few optimizer steps through ring attention: loss and gradients stay finite (reused memory included).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        loss = model(**cp_batch).loss
        loss.backward()
        assert torch.isfinite(loss), loss
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        print(f"CP-OK relative error {error:.2e}, loss {out.loss.item():.4f} vs {reference.loss.item():.4f}")
    # Both ranks reach the end before either tears gloo down: a rank leaving early aborts the other's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Leave without interpreter finalization: there, gloo's worker threads can still hold collective work objects
    # whose destruction aborts the process (SIGABRT, "terminate called without an active exception") after the
    # work is done and reported. Nothing is left to flush but stdout.
    sys.stdout.flush()
    os._exit(0)
