"""Where a rank's stream stands and what it reads next: positions (``Cursor``), a pass's files (``Unit``,
``PassOrder``), and moving a position to other window settings.

Who reads what: with at least as many files as data-parallel ranks, rank r reads files r, r + n, r + 2n, ... in a new
seeded order every epoch; with fewer files, every rank reads every file and keeps records r, r + n, ... of each.

A run resumed on another number of DP ranks (``dataset.GenomicStream.continue_from``) first reads what the old ranks
had left of their passes: a ``leftover`` list of units, some starting where an old rank had stopped, dealt out to the
new ranks as their pass ``first_epoch - 1``; their own epochs start at ``first_epoch``.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cursor:
    """The next unread token: ``offset`` tokens into window ``window`` of record ``record`` (its index in the file)
    of the ``file``-th unit of this rank's order for ``epoch``."""

    epoch: int = 0
    file: int = 0
    record: int = 0
    window: int = 0
    offset: int = 0


@dataclass(frozen=True)
class Unit:
    """One file's share of a rank's pass: the records ``index % keep_every == keep_from`` of file number ``file`` of
    the dataset, from token ``offset`` of window ``window`` of record ``record`` on. A normal epoch's units are the
    rank's files from their start; a leftover pass's may start where an old rank had stopped."""

    file: int
    keep_every: int = 1
    keep_from: int = 0
    record: int = 0
    window: int = 0
    offset: int = 0

    def keeps(self, index: int) -> bool:
        return index % self.keep_every == self.keep_from

    def start(self) -> tuple[int, int, int]:
        return (self.record, self.window, self.offset)


class PassOrder:
    """The units any DP rank reads in any epoch, for ``num_files`` files (shuffled per epoch and rank if ``shuffle``)."""

    def __init__(self, num_files: int, seed: int, shuffle: bool):
        self.num_files, self.seed, self.shuffle = num_files, seed, shuffle

    def units(
        self, epoch: int, dp_rank: int, dp_world_size: int, leftover: list[Unit] = (), first_epoch: int = 0
    ) -> list[Unit]:
        if epoch < first_epoch:
            return list(leftover[dp_rank::dp_world_size])
        if self.num_files >= dp_world_size:  # whole files per rank
            files = list(range(dp_rank, self.num_files, dp_world_size))
            keep_every, keep_from = 1, 0
        else:  # every rank reads every file and keeps its every n-th record
            files, keep_every, keep_from = list(range(self.num_files)), dp_world_size, dp_rank
        if self.shuffle:
            files = [files[i] for i in np.random.default_rng([self.seed, epoch, dp_rank]).permutation(len(files))]
        return [Unit(file, keep_every, keep_from) for file in files]


def moved_position(position: tuple[int, int, int], old_stride: int, stride: int) -> tuple[int, int, int]:
    """(record, window, offset) written with windows ``old_stride`` apart, for windows ``stride`` apart: the same token
    of the record (windows start every stride tokens), possibly past the record's last window (``in_last_window``)."""
    record, window, offset = position
    token = window * old_stride + offset
    return record, token // stride, token % stride


def in_last_window(begin: tuple[int, int, int], num_windows: int, stride: int) -> tuple[int, int, int]:
    """``begin`` naming a window past a record's last (``moved_position``): its token is then in the last one, whose
    start is a whole number of strides in too."""
    record, window, offset = begin
    last = num_windows - 1
    return record, last, (window - last) * stride + offset
