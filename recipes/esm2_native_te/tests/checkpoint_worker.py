"""torchrun worker for test_checkpoint.py: train a toy model, checkpoint mid-way, resume into fresh objects.

Usage: checkpoint_worker.py <ddp|fsdp2|mfsdp> <sync|async> <ckpt_dir> <result_file>

``mfsdp`` checkpoints the way train_mfsdp.py does (the modules' and optimizer's own DTensor state dicts, the optimizer
state created up front); Megatron-FSDP itself shards only on GPUs, so here FSDP2 makes the DTensor parameters.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint import COMPLETE_MARKER, Checkpointer
from distributed import cleanup_distributed, setup_distributed
from scheduler import get_linear_schedule_with_warmup
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


TOTAL_STEPS, SAVE_AT = 6, 3


def build_training(strategy: str, lr: float = 1e-2, weight_decay: float = 1e-2):
    """A toy model (the same initial weights on every rank), sharded or wrapped, with AdamW and a schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    if strategy in ("fsdp2", "mfsdp"):
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if strategy == "mfsdp":  # Megatron-FSDP's optimizer holds its state from the start: a resume loads into it
        for param in model.parameters():
            zeros = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            optimizer.state[param] = {"step": torch.tensor(0.0), **zeros}
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_decay_steps=10)
    return model, optimizer, scheduler


def build(strategy: str, rank: int, world_size: int, **optimizer_settings):
    model, optimizer, scheduler = build_training(strategy, **optimizer_settings)
    data = TensorDataset(torch.arange(64, dtype=torch.float32).reshape(-1, 1).repeat(1, 8) / 64)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=1)
    loader = StatefulDataLoader(data, batch_size=2, sampler=sampler)
    return model, optimizer, scheduler, loader


def batches_of(loader):
    # Creating a DataLoader iterator draws a seed from the global RNG; keep that draw from shifting the stream a
    # resumed run restores (the training scripts do the same).
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


def train_steps(model, optimizer, scheduler, batches, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        (x,) = next(batches)
        noise = torch.randn(x.shape[0], 1)  # draws from the global RNG, which the checkpoint must restore
        loss = ((model(x) - noise) ** 2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def full_params(model, strategy: str) -> dict[str, torch.Tensor]:
    sharded = strategy in ("fsdp2", "mfsdp")
    return {k: (v.full_tensor() if sharded else v).detach().clone() for k, v in model.named_parameters()}


def main():
    strategy, mode, ckpt_dir, result_file = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    dist_config, _ = setup_distributed(require_process_group=True)
    rank, world = dist_config.rank, dist_config.world_size
    checkpointer = Checkpointer(ckpt_dir, strategy, async_save=mode == "async", max_checkpoints=2)
    events = {}

    # Uninterrupted run, with a checkpoint at SAVE_AT.
    model, optimizer, scheduler, loader = build(strategy, rank, world)
    batches = batches_of(loader)
    losses = train_steps(model, optimizer, scheduler, batches, SAVE_AT)
    checkpointer.save(SAVE_AT, model, optimizer, scheduler, loader)
    events["final_dir_right_after_save"] = (ckpt_dir / f"step_{SAVE_AT}").exists()
    events["tmp_dir_right_after_save"] = (ckpt_dir / f"step_{SAVE_AT}.tmp").exists()
    events["pending_after_save"] = checkpointer._pending is not None
    losses += train_steps(model, optimizer, scheduler, batches, TOTAL_STEPS - SAVE_AT)
    expected_params = full_params(model, strategy)
    checkpointer.close()
    events["complete_after_close"] = (ckpt_dir / f"step_{SAVE_AT}" / COMPLETE_MARKER).is_file()
    events["rank_files"] = sorted(p.name for p in (ckpt_dir / f"step_{SAVE_AT}").glob("rank*_state.pt"))

    # Debris a crashed run might leave behind; resume must pass over both.
    if rank == 0:
        (ckpt_dir / "step_9.tmp").mkdir()
        (ckpt_dir / "step_8").mkdir()
    dist.barrier()

    # Stop-and-go: fresh objects (and a scrambled RNG), resumed from the checkpoint.
    torch.manual_seed(1234)
    model, optimizer, scheduler, loader = build(strategy, rank, world)
    torch.manual_seed(999)
    resumed_step = checkpointer.load_latest(model, optimizer, scheduler, loader)
    resumed_exp_avg = {name: _full(optimizer.state[param]["exp_avg"]) for name, param in model.named_parameters()}
    resumed_losses = train_steps(model, optimizer, scheduler, batches_of(loader), TOTAL_STEPS - resumed_step)
    resumed_params = full_params(model, strategy)
    checkpointer.close()

    # A resume with another lr and weight decay in its config: those apply, the weights and AdamW's moments are the
    # checkpoint's.
    model, optimizer, scheduler, loader = build(strategy, rank, world, lr=5e-3, weight_decay=0.1)
    checkpointer.load_latest(model, optimizer, scheduler, loader)
    changed = {
        "lr": [group["lr"] for group in optimizer.param_groups],
        "last_lr": scheduler.get_last_lr(),
        "weight_decay": [group["weight_decay"] for group in optimizer.param_groups],
        "params": full_params(model, strategy),
        "exp_avg": {name: _full(optimizer.state[param]["exp_avg"]) for name, param in model.named_parameters()},
    }
    changed["loss"] = train_steps(model, optimizer, scheduler, batches_of(loader), 1)[0]
    changed["next_lr"] = [group["lr"] for group in optimizer.param_groups]
    checkpointer.close()

    if rank == 0:
        torch.save(
            {
                "events": events,
                "losses": losses,
                "resumed_step": resumed_step,
                "resumed_losses": resumed_losses,
                "expected_params": expected_params,
                "resumed_params": resumed_params,
                "resumed_exp_avg": resumed_exp_avg,
                "changed": changed,
            },
            result_file,
        )
    cleanup_distributed()


if __name__ == "__main__":
    main()
