# Copied from common/prediction_files.py — edit the source, then run ci/check_copies.py --fix
"""Inference over many rows with one or more processes: packed passes, and the ranks' results joined into one table and
one embedding matrix that are always whole on disk.

- :func:`packed_passes` cuts rows, in input order, into runs whose tokens fit one packed (THD) forward pass.
- Each rank takes a contiguous share of the rows (:func:`contiguous_share`), so the shares joined in rank order are in
  input order. It writes ``<table_name>.rank<r>.parquet`` and ``embeddings.rank<r>.npy``
  (:func:`write_rank_files`); once every rank has, rank 0 joins them (:func:`merge_rank_files`) into
  ``<table_name>.parquet`` and ``embeddings.npy``, each written under a temporary name and then renamed, so a file
  under its final name is always complete, and removes the rank files.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def packed_passes(lengths: list[int], token_budget: int) -> Iterator[range]:
    """Consecutive runs of row indices whose tokens fit ``token_budget`` together (a longer row runs alone)."""
    start, tokens = 0, 0
    for index, length in enumerate(lengths):
        if index > start and tokens + length > token_budget:
            yield range(start, index)
            start, tokens = index, 0
        tokens += length
    if start < len(lengths):
        yield range(start, len(lengths))


def contiguous_share(n_rows: int, rank: int, world_size: int) -> np.ndarray:
    """The row indices rank ``rank`` of ``world_size`` takes: a contiguous run, the ranks' runs in order covering
    ``0..n_rows - 1`` once (the first ``n_rows % world_size`` ranks take one row more)."""
    return np.array_split(np.arange(n_rows), world_size)[rank]


def write_rank_files(output_dir: Path, rank: int, table: pa.Table, embeddings: np.ndarray, table_name: str) -> None:
    """This rank's rows (its contiguous share, in input order) and their embeddings ([rows, hidden] float32)."""
    if len(table) != len(embeddings):
        raise ValueError(f"rank {rank}: {len(table)} rows but {len(embeddings)} embeddings")
    pq.write_table(table, output_dir / f"{table_name}.rank{rank}.parquet")
    np.save(output_dir / f"embeddings.rank{rank}.npy", embeddings)


def merge_rank_files(output_dir: Path, world_size: int, table_name: str) -> tuple[Path, Path]:
    """Join the ranks' files in rank order (= input order) into ``<table_name>.parquet`` and ``embeddings.npy``;
    each is written whole under a temporary name and then renamed. Returns the two paths."""
    table_files = [output_dir / f"{table_name}.rank{rank}.parquet" for rank in range(world_size)]
    array_files = [output_dir / f"embeddings.rank{rank}.npy" for rank in range(world_size)]
    arrays = [np.load(path) for path in array_files]
    arrays = [array for array in arrays if array.size] or arrays[:1]  # a rank with no rows wrote a 0 x 0 array
    table, embeddings = output_dir / f"{table_name}.parquet", output_dir / "embeddings.npy"
    partial_table, partial_embeddings = (
        output_dir / f".{table.name}.partial",
        output_dir / f".{embeddings.name}.partial",
    )
    pq.write_table(pa.concat_tables([pq.read_table(path) for path in table_files]), partial_table)
    with open(partial_embeddings, "wb") as handle:
        np.save(handle, np.concatenate(arrays).astype(np.float32))
    os.replace(partial_table, table)
    os.replace(partial_embeddings, embeddings)
    for path in table_files + array_files:
        path.unlink()
    return table, embeddings
