# Copied from common/epoch_batch_sampler.py — edit the source, then run ci/check_copies.py --fix
"""Endless, resumable batches of ``(epoch, row)`` for one data-parallel rank: the order in which every map-style
dataset of the recipes is read (protein sequences, Geneformer cells, codon sequences, images).

``EpochBatchSampler`` is a batch sampler for ``torchdata.stateful_dataloader.StatefulDataLoader``; its
``state_dict()`` is the position at a batch boundary, so a resumed loader yields the same batches as an uninterrupted
one. A run resumed on another number of data-parallel ranks continues the epoch instead of starting it again
(``continue_from``): the rows that the earlier ranks had not read yet are dealt out to the new ranks.
``batches_in_order`` cuts held-out rows into batches by the same rule, in one ordered pass.
"""

import numpy as np
import torch
from user_errors import ConfigError


class EpochBatchSampler:
    """Endless, resumable batches of ``(epoch, row)`` for one DP rank.

    Each epoch orders the usable ``rows`` as ``torch.utils.data.DistributedSampler(drop_last=True)`` does (one
    permutation seeded with ``seed + epoch``, the same on every rank; rank r of n takes every n-th position from r)
    and cuts that order into batches: ``micro_batch_size`` rows (BSHD) or greedily as many rows as fit
    ``token_budget`` by ``lengths`` (THD). Batches never span epochs. The state is ``(epoch, rows consumed this
    epoch)``, always at a batch boundary, so a resumed sampler yields the same batches as an uninterrupted one.

    After ``continue_from`` (a resume on another number of ranks) the state also holds the earlier worlds' positions
    (``history``): in the epochs they had started, the permutation first loses the rows they had read, and what is
    left is dealt out to this world's ranks the same way.
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
        self.shuffle, self.seed = shuffle, seed
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.epoch, self.consumed = 0, 0
        # Earlier worlds of this run, oldest first: {"dp_world_size": W, "positions": [[epoch, consumed] per DP rank]}.
        self.history: list[dict] = []

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "num_rows": len(self.rows),
            "history": [
                {"dp_world_size": w["dp_world_size"], "positions": list(w["positions"])} for w in self.history
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.history = list(state.get("history", []))

    @staticmethod
    def position_in(loader_state: dict | None) -> dict | None:
        """This sampler's state inside a ``StatefulDataLoader`` state (with or without worker processes), if any."""
        if not loader_state:
            return None
        main = loader_state.get("_snapshot", {}).get("_main_snapshot", loader_state)
        return main.get("_index_sampler_state")

    def reads_like(self, state: dict) -> bool:
        """Whether ``state`` was saved by the sampler of this DP rank in a world of this size over as many usable rows
        (older states, which do not say, are taken to be). A position in another number of rows would name other
        rows: ``continue_from`` refuses it, and the data starts afresh with a warning."""
        here = {"dp_world_size": self.dp_world_size, "dp_rank": self.dp_rank, "num_rows": len(self.rows)}
        return all(state.get(key, value) == value for key, value in here.items())

    def continue_from(self, states: list[dict]) -> str:
        """Continue where the ranks of an earlier world (``states``: every one of their sampler states, in any order;
        the CP ranks of one DP group hold equal ones) stopped, on this world's ranks; returns what it did, for the log.

        Raises ``ValueError`` when ``states`` cannot describe that world (an older format, ranks missing or
        disagreeing, another number of usable rows): the caller then starts the data afresh. The seed and shuffling
        must be the run's own, as for any resume.
        """
        if any("dp_world_size" not in s or "dp_rank" not in s for s in states):
            raise ValueError("the checkpoint's data positions predate resuming on another number of ranks")
        old_world = {int(s["dp_world_size"]) for s in states}
        if len(old_world) != 1:
            raise ValueError(f"its ranks disagree on the number of data-parallel ranks ({sorted(old_world)})")
        (old_world,) = old_world
        positions: dict[int, tuple[int, int]] = {}
        for s in states:
            position = (int(s["epoch"]), int(s["consumed"]))
            if positions.setdefault(int(s["dp_rank"]), position) != position:
                raise ValueError(f"the ranks of data-parallel rank {s['dp_rank']} stopped at different positions")
        if sorted(positions) != list(range(old_world)):
            raise ValueError(f"it holds the data positions of DP ranks {sorted(positions)} of {old_world}")
        if any(int(s.get("num_rows", -1)) != len(self.rows) for s in states):
            raise ValueError(f"it was reading another dataset (this one has {len(self.rows)} usable rows)")
        histories = [s["history"] for s in states]
        if any(h != histories[0] for h in histories):
            raise ValueError("its ranks disagree on the earlier worlds of the run")
        stopped_at = [list(positions[rank]) for rank in range(old_world)]
        self.history = [*histories[0], {"dp_world_size": old_world, "positions": stopped_at}]
        self.epoch, self.consumed = min(epoch for epoch, _ in positions.values()), 0
        unread = len(self._unread(self.epoch))
        return (
            f"data: {old_world} DP ranks had read {len(self.rows) - unread} of epoch {self.epoch}'s {len(self.rows)} "
            f"rows; the other {unread} are dealt out to {self.dp_world_size} DP rank(s)"
        )

    # ----------------------------------------------------------------------------------------------------------------

    def _permutation(self, epoch: int) -> np.ndarray:
        """Positions into ``rows`` in the order of ``epoch``: DistributedSampler's permutation (same seed, same draw)."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=generator).numpy()

    @staticmethod
    def _share(order: np.ndarray, dp_rank: int, dp_world_size: int) -> np.ndarray:
        """Rank ``dp_rank``'s every-n-th share of ``order``, the same length on every rank (drop_last)."""
        per_rank = len(order) // dp_world_size
        return order[dp_rank : per_rank * dp_world_size : dp_world_size]

    def _unread(self, epoch: int) -> np.ndarray:
        """``epoch``'s permutation without the rows the earlier worlds read in it, in permutation order."""
        order = self._permutation(epoch)
        for world in self.history:
            read = [
                share if at_epoch > epoch else share[:consumed]
                for rank, (at_epoch, consumed) in enumerate(world["positions"])
                if at_epoch >= epoch
                for share in [self._share(order, rank, world["dp_world_size"])]
            ]
            if read:
                order = order[~np.isin(order, np.concatenate(read))]
        return order

    def _batch_end(self, order: np.ndarray, start: int) -> int:
        return _batch_end(order, start, self.lengths, self.micro_batch_size, self.token_budget)

    def __iter__(self):
        while True:
            order = self.rows[self._share(self._unread(self.epoch), self.dp_rank, self.dp_world_size)]
            while self.consumed < len(order):
                start, self.consumed = self.consumed, self._batch_end(order, self.consumed)
                yield [(self.epoch, int(row)) for row in order[start : self.consumed]]
            self.epoch, self.consumed = self.epoch + 1, 0


def _batch_end(order: np.ndarray, start: int, lengths, micro_batch_size: int | None, token_budget: int | None) -> int:
    """Where the batch that starts at ``order[start]`` ends: ``micro_batch_size`` rows, or as many as fit
    ``token_budget`` by ``lengths``."""
    if token_budget is None:
        return min(start + micro_batch_size, len(order))
    end, total = start, 0
    while end < len(order) and total + lengths[order[end]] <= token_budget:
        total += lengths[order[end]]
        end += 1
    if end == start:
        raise ConfigError(
            f"row {order[start]} has {lengths[order[start]]} tokens > token_budget; raise dataset.token_budget"
        )
    return end


def batches_in_order(rows, lengths=None, *, micro_batch_size=None, token_budget=None) -> list[np.ndarray]:
    """``rows`` cut into batches in their own order by the sampler's rule, every row once (nothing dropped): one pass
    over held-out data."""
    if (micro_batch_size is None) == (token_budget is None):
        raise ConfigError("give exactly one of micro_batch_size and token_budget")
    rows = np.asarray(rows, dtype=np.int64)
    lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    batches, start = [], 0
    while start < len(rows):
        end = _batch_end(rows, start, lengths, micro_batch_size, token_budget)
        batches.append(rows[start:end])
        start = end
    return batches
