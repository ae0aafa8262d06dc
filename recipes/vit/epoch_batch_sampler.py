# Copied from common/epoch_batch_sampler.py — edit the source, then run ci/check_copies.py --fix
"""Endless, resumable batches of ``(epoch, row)`` for one data-parallel rank: the order in which every map-style
dataset of the recipes is read (protein sequences, Geneformer cells).

``EpochBatchSampler`` is a batch sampler for ``torchdata.stateful_dataloader.StatefulDataLoader``; its
``state_dict()`` is the position at a batch boundary, so a resumed loader yields the same batches as an uninterrupted
one.
"""

import numpy as np
from torch.utils.data.distributed import DistributedSampler
from user_errors import ConfigError


class EpochBatchSampler:
    """Endless, resumable batches of ``(epoch, row)`` for one DP rank.

    Each epoch orders the usable ``rows`` with a ``DistributedSampler`` (set_epoch on rollover) and cuts that order
    into batches: ``micro_batch_size`` rows (BSHD) or greedily as many rows as fit ``token_budget`` by ``lengths``
    (THD). Batches never span epochs. The state is ``(epoch, rows consumed this epoch)``, always at a batch
    boundary, so a resumed sampler yields the same batches as an uninterrupted one.
    """

    def __init__(self, rows, lengths=None, shuffle=True, *, dp_rank, dp_world_size, seed, micro_batch_size=None,
                 token_budget=None):  # fmt: skip
        if (micro_batch_size is None) == (token_budget is None):
            raise ConfigError("give exactly one of micro_batch_size and token_budget")
        if len(rows) < dp_world_size:
            raise ConfigError(
                f"{len(rows)} usable sequences cannot feed {dp_world_size} data-parallel ranks; use more data or "
                "fewer ranks"
            )
        self.rows = np.asarray(rows, dtype=np.int64)
        self.lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self.micro_batch_size, self.token_budget = micro_batch_size, token_budget
        self.sampler = DistributedSampler(
            self.rows, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.epoch, self.consumed = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])

    def _batch_end(self, order: np.ndarray, start: int) -> int:
        if self.token_budget is None:
            return min(start + self.micro_batch_size, len(order))
        end, total = start, 0
        while end < len(order) and total + self.lengths[order[end]] <= self.token_budget:
            total += self.lengths[order[end]]
            end += 1
        if end == start:
            raise ConfigError(
                f"row {order[start]} has {self.lengths[order[start]]} tokens > token_budget; raise dataset.token_budget"
            )
        return end

    def __iter__(self):
        while True:
            self.sampler.set_epoch(self.epoch)
            order = self.rows[list(self.sampler)]
            while self.consumed < len(order):
                start, self.consumed = self.consumed, self._batch_end(order, self.consumed)
                yield [(self.epoch, int(row)) for row in order[start : self.consumed]]
            self.epoch, self.consumed = self.epoch + 1, 0
