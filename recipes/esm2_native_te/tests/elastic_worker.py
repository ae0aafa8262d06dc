"""torchrun worker for test_checkpoint.py: save on one number of ranks, resume on another.

Usage: elastic_worker.py <ddp|fsdp2> <save|resume> <ckpt_dir> <result_file>

``save`` trains a toy model for SAVE_AT steps on map-style data read through the recipes' ``EpochBatchSampler`` and a
``StatefulDataLoader`` with a worker process, checkpoints, and records the full weights, the full optimizer state and
the rows every rank read. ``resume`` (launched with another number of processes) builds fresh objects, loads the
checkpoint, records the same, then reads the rest of the epoch in lockstep and records those rows.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from checkpoint import Checkpointer
from checkpoint_worker import build_training
from distributed import cleanup_distributed, setup_distributed
from epoch_batch_sampler import EpochBatchSampler
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader


SAVE_AT, ROWS = 3, 61


class Rows(torch.utils.data.Dataset):
    """Row ``r`` of epoch ``e``: features that depend on the row, the row id and the epoch (to see who read what)."""

    def __getitem__(self, key):
        epoch, row = key
        return torch.full((8,), row / ROWS), row, epoch

    def __len__(self):
        return ROWS


def build(strategy: str, rank: int, world_size: int):
    model, optimizer, scheduler = build_training(strategy)  # checkpoint_worker.py's toy model
    sampler = EpochBatchSampler(np.arange(ROWS), dp_rank=rank, dp_world_size=world_size, seed=1, micro_batch_size=2)
    loader = StatefulDataLoader(Rows(), batch_sampler=sampler, num_workers=1)
    return model, optimizer, scheduler, loader


def full_state(model, optimizer) -> dict[str, dict]:
    """Unsharded weights and optimizer state by parameter name, the same for DDP and FSDP2 (a collective)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    # Copies: with one process the full state may share storage with the live tensors that training then updates.
    copy = {k: v.detach().clone() for k, v in model_state.items()}
    moments = {name: {k: v.clone() for k, v in state.items()} for name, state in optim_state["state"].items()}
    return {"model": copy, "optimizer": moments}


def main():
    strategy, phase, ckpt_dir, result_file = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    dist_config, _ = setup_distributed(require_process_group=True)
    rank, world = dist_config.rank, dist_config.world_size
    checkpointer = Checkpointer(ckpt_dir, strategy)
    model, optimizer, scheduler, loader = build(strategy, rank, world)
    step = SAVE_AT if phase == "save" else checkpointer.load_latest(model, optimizer, scheduler, loader)
    batches = iter(loader)

    def train_on(x) -> None:
        (model(x) ** 2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    rows = []
    if phase == "save":
        for _ in range(SAVE_AT):
            x, batch_rows, _ = next(batches)
            rows += batch_rows.tolist()
            train_on(x)
        checkpointer.save(SAVE_AT, model, optimizer, scheduler, loader)
        state = full_state(model, optimizer)
    else:
        state = full_state(model, optimizer)
        # Every rank stops at its first batch of the next epoch (each reads the same number of rows of this one).
        while True:
            x, batch_rows, epochs = next(batches)
            if int(epochs[0]) != 0:
                break
            rows += batch_rows.tolist()
            train_on(x)
    checkpointer.close()
    every_rank = [None] * world
    dist.all_gather_object(every_rank, rows)
    if rank == 0:
        torch.save({"step": step, "state": state, "rows": every_rank}, result_file)
    cleanup_distributed()


if __name__ == "__main__":
    main()
