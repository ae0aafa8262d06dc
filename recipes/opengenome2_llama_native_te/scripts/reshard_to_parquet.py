"""Reshard JSONL(.gz)/FASTA(.gz) DNA into globally shuffled Parquet shards, with bounded memory.

    python scripts/reshard_to_parquet.py '/data/og2/train/*.jsonl.gz' --output-dir /data/og2_shuffled \
        --rows-per-shard 100000 --chunk-length 8190 --chunk-overlap 200 --seed 1234

Two passes over the data, never more than one bucket in memory (a two-pass shuffle):

1. stream every input record once and append it to one of ``--num-buckets`` temporary files, chosen at random;
2. load one bucket at a time, permute its rows, and write the rows out in bucket order as shards of
   ``--rows-per-shard`` rows (``shard_00000.parquet``, ...).

Random bucket assignment followed by a random order within each bucket is a uniformly random permutation of all rows,
so any stretch of the output (a shard, a row group, a rank's share) is a random sample of the corpus. The same inputs,
options and ``--seed`` give the same shards.

``--chunk-length N`` first cuts each sequence into chunks of N bases that overlap by ``--chunk-overlap`` and shuffles
chunks, not whole sequences: otherwise the windows of one long contig still reach the model back to back. Chunk rows
carry ``seq_start``/``seq_end`` flags, so the training data loader puts ``<bos>``/``<eos>`` only at the true ends of
the original sequence. With ``--chunk-length = max_seq_length - 2`` every chunk is one training window.

Output columns: ``id`` (FASTA header / ``<file>:<record>``, plus ``:<start>-<end>`` for chunks), the sequence column
(``--sequence-column``, default ``text``), and ``seq_start``/``seq_end`` when chunking. ``manifest.json`` records the
inputs, options and row counts.
"""

import argparse
import json
import logging
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe's flat modules
from dataset import END_COLUMN, START_COLUMN, file_format, iter_fasta, iter_records, resolve_files
from sequence_windows import window_starts


logger = logging.getLogger("reshard_to_parquet")
BUCKET_TARGET_BYTES = 512 * 2**20  # what one bucket may hold in memory in pass 2, by default


def input_files(inputs: list[str]) -> list[Path]:
    files = []
    for path in inputs:
        for file in resolve_files(path):
            kind = file_format(file)
            if kind not in ("jsonl", "fasta"):
                raise ValueError(f"{file}: input must be JSONL(.gz) or FASTA(.gz), not {kind}")
            files.append(file)
    return files


def read_sequences(file: Path, column: str):
    """(id, sequence) for every record of ``file``, streamed."""
    if file_format(file) == "fasta":
        for index, (header, sequence) in enumerate(iter_fasta(file)):
            yield header.split()[0] if header.strip() else f"{file.name}:{index}", sequence
    else:
        for index, record in iter_records(file, "jsonl", column):
            yield f"{file.name}:{index}", record.text


def rows_of(identifier: str, sequence: str, chunk_length: int, chunk_overlap: int):
    """One row per sequence, or per chunk with its place in the original sequence (none for an empty one)."""
    if not sequence:
        return
    if not chunk_length:
        yield {"id": identifier, "text": sequence}
        return
    starts = window_starts(len(sequence), chunk_length, chunk_overlap)
    for number, start in enumerate(starts):
        end = min(start + chunk_length, len(sequence))
        yield {
            "id": f"{identifier}:{start}-{end}",
            "text": sequence[start:end],
            START_COLUMN: number == 0,
            END_COLUMN: number == len(starts) - 1,
        }


def default_num_buckets(files: list[Path]) -> int:
    # Assume gzip shrinks DNA about fourfold; a bucket then holds about BUCKET_TARGET_BYTES of sequence.
    estimate = sum(f.stat().st_size * (4 if f.name.endswith(".gz") else 1) for f in files)
    return max(1, math.ceil(estimate / BUCKET_TARGET_BYTES))


def reshard(
    inputs: list[str],
    output_dir: Path,
    rows_per_shard: int = 100_000,
    seed: int = 0,
    sequence_column: str = "text",
    chunk_length: int = 0,
    chunk_overlap: int = 0,
    num_buckets: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Write the shards and ``manifest.json``; returns the manifest."""
    if rows_per_shard < 1:
        raise ValueError(f"--rows-per-shard must be positive, got {rows_per_shard}")
    if chunk_length and not 0 <= chunk_overlap < chunk_length:
        raise ValueError(f"--chunk-overlap must be in [0, --chunk-length), got {chunk_overlap}")
    files = input_files(inputs)
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{output_dir} is not empty; pass --overwrite to replace its contents")
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    num_buckets = num_buckets or default_num_buckets(files)
    rng = np.random.default_rng(seed)
    tmp = output_dir / ".buckets"
    tmp.mkdir()
    try:
        # Pass 1: scatter rows over the buckets. Appending in batches keeps the number of open files at one.
        pending, sequences, rows, unflushed = [[] for _ in range(num_buckets)], 0, 0, 0
        with tqdm(desc="pass 1/2: records", unit=" seq", disable=not progress) as bar:
            for file in files:
                for identifier, sequence in read_sequences(file, sequence_column):
                    sequences += 1
                    bar.update(1)
                    for row in rows_of(identifier, "".join(sequence.split()), chunk_length, chunk_overlap):
                        pending[rng.integers(num_buckets)].append(json.dumps(row))
                        rows, unflushed = rows + 1, unflushed + 1
                    if unflushed >= 10_000:
                        _flush(tmp, pending)
                        unflushed = 0
        _flush(tmp, pending)
        if rows == 0:
            raise ValueError(f"no sequences found in {[str(f) for f in files]}")
        logger.info("pass 1/2: %d sequences scattered as %d rows over %d buckets", sequences, rows, num_buckets)

        # Pass 2: permute each bucket in memory and cut the concatenation into shards.
        writer = _ShardWriter(output_dir, rows_per_shard, sequence_column, chunked=bool(chunk_length))
        for bucket in tqdm(range(num_buckets), desc="pass 2/2: buckets", disable=not progress):
            path = tmp / f"{bucket}.jsonl"
            if not path.exists():
                continue
            lines = path.read_text().splitlines()
            for index in rng.permutation(len(lines)):
                writer.add(json.loads(lines[index]))
            path.unlink()
        writer.close()
        logger.info("pass 2/2: %d buckets shuffled and cut into %d shard(s)", num_buckets, len(writer.shards))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    manifest = {
        "inputs": [str(f) for f in files],
        "sequences": sequences,
        "rows": rows,
        "shards": writer.shards,
        "rows_per_shard": rows_per_shard,
        "seed": seed,
        "sequence_column": sequence_column,
        "chunk_length": chunk_length,
        "chunk_overlap": chunk_overlap,
        "num_buckets": num_buckets,
    }
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info(
        "wrote %d rows from %d sequences into %d shard(s) in %s", rows, sequences, len(writer.shards), output_dir
    )
    return manifest


def _flush(tmp: Path, pending: list[list[str]]) -> None:
    for bucket, lines in enumerate(pending):
        if lines:
            with open(tmp / f"{bucket}.jsonl", "a") as fh:
                fh.write("\n".join(lines) + "\n")
            lines.clear()


class _ShardWriter:
    """Collects rows and writes a Parquet shard every ``rows_per_shard`` rows (row groups of at most 1,024 rows, so a
    reader resuming mid-shard skips whole groups by their metadata)."""

    def __init__(self, output_dir: Path, rows_per_shard: int, sequence_column: str, chunked: bool):
        self.output_dir, self.rows_per_shard, self.column = output_dir, rows_per_shard, sequence_column
        self.keys = ["id", "text", START_COLUMN, END_COLUMN] if chunked else ["id", "text"]
        self.rows: list[dict] = []
        self.shards: list[str] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) == self.rows_per_shard:
            self._write()

    def close(self) -> None:
        if self.rows:
            self._write()

    def _write(self) -> None:
        # "text" is the rows' internal name; the shard names the column as the data loader will read it.
        columns = {self.column if key == "text" else key: [row[key] for row in self.rows] for key in self.keys}
        name = f"shard_{len(self.shards):05d}.parquet"
        pq.write_table(pa.table(columns), self.output_dir / name, row_group_size=1024, compression="zstd")
        self.shards.append(name)
        self.rows = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="JSONL(.gz) or FASTA(.gz) files, directories or quoted globs")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--rows-per-shard", type=int, default=100_000, help="rows per Parquet shard (default 100000)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
    parser.add_argument("--sequence-column", default="text", help="JSON key to read and column to write (text)")
    parser.add_argument("--chunk-length", type=int, default=0, help="cut sequences into chunks of N bases (0: no)")
    parser.add_argument("--chunk-overlap", type=int, default=0, help="bases shared by neighbouring chunks")
    parser.add_argument("--num-buckets", type=int, default=None, help="temporary buckets (default: ~512 MB each)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    parser.add_argument("--quiet", action="store_true", help="no progress bars (off anyway when not on a terminal)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        reshard(
            args.inputs,
            args.output_dir,
            rows_per_shard=args.rows_per_shard,
            seed=args.seed,
            sequence_column=args.sequence_column,
            chunk_length=args.chunk_length,
            chunk_overlap=args.chunk_overlap,
            num_buckets=args.num_buckets,
            overwrite=args.overwrite,
            progress=not args.quiet and sys.stderr.isatty(),  # off a terminal a bar is one line of carriage returns
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"reshard_to_parquet: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
