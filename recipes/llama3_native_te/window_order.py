"""The order in which a training run reads its windows, also across resumes on another number of data-parallel ranks.

Every epoch permutes all windows with ``[seed, epoch]``; DP rank ``r`` of ``n`` reads every n-th window of that
permutation from ``r``, and starts the next epoch when its share is done.

A run resumed on another number of DP ranks keeps the earlier worlds in a ``history`` (oldest first, each
``{"dp_world_size": W, "positions": [[epoch, windows started in it] per DP rank]}``). From the oldest epoch any of
the last world's ranks was still in, each epoch's permutation first loses the windows the earlier worlds had read
in it, and what is left is dealt out to this world's ranks the same way. So no window is read twice in an epoch and
none is skipped, but for the unread tail of a window that packing had split over two batches when the run stopped.
"""

from collections.abc import Iterator
from itertools import islice

import numpy as np


class WindowOrder:
    """Window positions (indices into the dataset's window list) in reading order, per DP rank."""

    def __init__(self, num_windows: int, seed: int, shuffle: bool):
        self.num_windows, self.seed, self.shuffle = num_windows, seed, shuffle

    def permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def unread(self, epoch: int, history: list[dict]) -> np.ndarray:
        """``epoch``'s permutation without the windows the worlds of ``history`` read in it, in permutation order."""
        order = self.permutation(epoch)
        for world in history:
            # Each of this world's ranks read its share of what the worlds before it had left of the epoch: all of it
            # if the rank went on to a later epoch, else the windows it had started.
            read = [
                share if at_epoch > epoch else share[:started]
                for rank, (at_epoch, started) in enumerate(world["positions"])
                if at_epoch >= epoch
                for share in [order[rank :: world["dp_world_size"]]]
            ]
            if read:
                order = order[~np.isin(order, np.concatenate(read))]
        return order

    @staticmethod
    def first_epoch(history: list[dict]) -> int:
        """The epoch a world that follows ``history`` starts in: the oldest one the last world had not finished."""
        return min(epoch for epoch, _ in history[-1]["positions"]) if history else 0

    def stream(self, dp_rank: int, dp_world_size: int, history: list[dict]) -> Iterator[tuple[int, int, int]]:
        """Endless ``(epoch, index in this rank's share of the epoch, window position)`` of one DP rank."""
        epoch = self.first_epoch(history)
        while True:
            for index, position in enumerate(self.unread(epoch, history)[dp_rank::dp_world_size]):
                yield epoch, index, int(position)
            epoch += 1

    def position_after(self, dp_rank: int, dp_world_size: int, history: list[dict], windows: int) -> list[int]:
        """``[epoch, windows started in it]`` of a DP rank that has started ``windows`` windows of its stream."""
        if windows == 0:
            return [self.first_epoch(history), 0]
        epoch, index, _ = next(islice(self.stream(dp_rank, dp_world_size, history), windows - 1, None))
        return [epoch, index + 1]
