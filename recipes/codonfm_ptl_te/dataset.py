"""Coding sequences from FASTA, Parquet or CSV/TSV files: read, validate, truncate and tokenize them once, then serve
them as the samples the collators take.

``read_sequences(path, ...)`` reads a file or a directory of files (every file there with a known suffix, in sorted
order; other files are ignored and logged):

- FASTA: ``.fa``, ``.fasta``, ``.fna``, ``.ffn``; a record's id is the first word of its ``>`` header, its sequence the
  lines up to the next header (blank lines ignored);
- Parquet: ``.parquet``;
- CSV / TSV: ``.csv`` / ``.tsv``; a header row names the columns.

FASTA, CSV and TSV files may be gzipped (``.gz``). Table files need the ``sequence_column`` (default ``sequence``); an ``id`` column is
optional (without it a sequence is named ``<file>:<row>``), and fine-tuning reads ``label_column`` too, which must be
numeric (classification: integer classes 0, 1, ...).

Every sequence goes through ``sequences.check_coding_sequence`` under ``invalid_codon_policy``: ``error`` stops at the
first sequence that is not whole clean codons (the message names file, sequence and position), ``skip`` leaves it out,
``unk`` reads its bad codons as <UNK>. Sequences longer than ``max_codons`` codons keep their first ``max_codons``.
How many were read, skipped and truncated is logged. A sequence becomes ``<CLS>`` codons ``<SEP>``
(``sequences.encode``); all of them are held as one flat uint8 array (69 ids fit), shared copy-on-write with forked
dataloader workers.

A user error ends in one line (``user_errors.py``): a missing path (``PathNotFoundError``), and a ``ConfigError`` for
an unknown suffix, an empty file, a malformed FASTA or CSV, a missing column (the message lists the file's columns),
a label that is not a number, an invalid sequence under ``error``, or no usable sequence at all.

A sample (what the collators take) is ``{"input_ids": int64 array, "epoch": int, "sample_index": row}``, plus
``"label"`` when the data has labels; ``row`` numbers the sequences kept, over all files in order, and masking is a
pure function of ``(seed, epoch, sample_index)``.
"""

import csv
import gzip
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch
from sequences import InvalidCodingSequence, check_coding_sequence, encode
from user_errors import ConfigError, PathNotFoundError


logger = logging.getLogger(__name__)

RECIPE_DIR = Path(__file__).resolve().parent
FASTA_SUFFIXES = (".fa", ".fasta", ".fna", ".ffn")
FORMATS = {**dict.fromkeys(FASTA_SUFFIXES, "fasta"), ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"}
KNOWN_SUFFIXES = ", ".join(suffix if suffix == ".parquet" else f"{suffix}(.gz)" for suffix in FORMATS)
ID_COLUMN = "id"
TASKS = ("mlm", "regression", "classification")

# ------------------------------------------------------------------------------------------------------- files


def resolve_path(path) -> Path:
    """``path`` as given when it exists from the working directory (or is absolute), else inside the recipe folder."""
    given = Path(path).expanduser()
    return given if given.exists() or given.is_absolute() else RECIPE_DIR / given


def file_format(path: Path) -> str | None:
    """fasta | parquet | csv | tsv from the suffix (a trailing ``.gz`` is looked through), or None."""
    name = path.name.lower()
    fmt = FORMATS.get(Path(name.removesuffix(".gz")).suffix)
    return None if fmt == "parquet" and name.endswith(".gz") else fmt  # Parquet compresses inside the file


def data_files(path, key: str = "path") -> list[Path]:
    """The files ``path`` names: a file with a known suffix, or a directory's files with known suffixes, sorted."""
    resolved = resolve_path(path)
    if resolved.is_file():
        if file_format(resolved) is None:
            raise ConfigError(
                f"{key}={path}: unknown file type {resolved.name!r}; use FASTA, Parquet, CSV or TSV ({KNOWN_SUFFIXES})"
            )
        return [resolved]
    if resolved.is_dir():
        entries = sorted(p for p in resolved.iterdir() if p.is_file() and not p.name.startswith("."))
        files = [p for p in entries if file_format(p) is not None]
        ignored = [p.name for p in entries if file_format(p) is None]
        if not files:
            raise PathNotFoundError(
                f"{key}={path}: the directory holds no sequence file ({KNOWN_SUFFIXES})"
                + (f"; it has {ignored[:5]}" if ignored else "; it is empty")
            )
        if ignored:
            logger.info("%s: ignoring %d file(s) of unknown type, e.g. %s", path, len(ignored), ignored[0])
        return files
    raise PathNotFoundError(f"{key}={path}: no such file or directory; point {key} at a sequence file or a directory")


def _open_text(path: Path):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8", newline="")


# ---------------------------------------------------------------------------------------------------- readers


@dataclass
class RawRecords:
    """One file's records as read: names, sequences (None for a null cell) and, when asked for, labels."""

    names: list[str]
    sequences: list
    labels: np.ndarray | None = None


def read_fasta(path: Path) -> RawRecords:
    names, sequences, lines = [], [], None
    try:
        with _open_text(path) as handle:
            for line_no, line in enumerate(handle, start=1):
                line = line.strip()
                if not line:
                    continue
                if line.startswith(">"):
                    if lines is not None:
                        sequences.append("".join(lines))
                    words = line[1:].split()
                    names.append(words[0] if words else f"{path.name}:{len(names)}")
                    lines = []
                elif lines is None:
                    raise ConfigError(
                        f"malformed FASTA {path}: line {line_no} holds sequence before any '>' header; every record "
                        "starts with a '>id' line"
                    )
                else:
                    lines.append(line)
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
        raise ConfigError(f"{path}: not a readable FASTA text file ({error})") from None
    if lines is not None:
        sequences.append("".join(lines))
    if not names:
        raise ConfigError(f"{path}: empty FASTA file (no '>' record); point the data path at FASTA records")
    return RawRecords(names, sequences)


def _unreadable(path: Path, fmt: str, error: Exception) -> ConfigError:
    return ConfigError(f"{path}: not a readable {fmt.upper()} file: {' '.join(str(error).split())}")


def _column_names(path: Path, fmt: str) -> list[str]:
    """The file's columns (a CSV/TSV file's header row), read without reading the data."""
    if fmt == "parquet":
        try:
            return pq.read_schema(path).names
        except (pa.ArrowInvalid, OSError) as error:
            raise _unreadable(path, fmt, error) from None
    try:
        with _open_text(path) as handle:
            first = handle.readline()
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
        raise ConfigError(f"{path}: not a readable {fmt.upper()} text file ({error})") from None
    if not first.strip():
        raise ConfigError(f"{path}: empty {fmt.upper()} file (no header row); the first row names the columns")
    return next(csv.reader(io.StringIO(first), delimiter="\t" if fmt == "tsv" else ","))


def _read_columns(path: Path, fmt: str, columns: list[str]) -> pa.Table:
    try:
        if fmt == "parquet":
            return pq.read_table(path, columns=columns)
        # Everything is read as text: sequences and ids of digits stay text, and labels are parsed later, so that a
        # bad one is reported with its row.
        options = pa_csv.ConvertOptions(column_types=dict.fromkeys(columns, pa.string()), include_columns=columns)
        parse = pa_csv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",")
        return pa_csv.read_csv(path, parse_options=parse, convert_options=options)
    except (pa.ArrowInvalid, OSError) as error:
        raise _unreadable(path, fmt, error) from None


def _check_column(path: Path, columns: list[str], name: str, key: str) -> None:
    if name not in columns:
        raise ConfigError(
            f"{path}: no column {name!r}; its columns are {columns}: set {key} to the column that holds "
            + ("the sequences" if key == "sequence_column" else "the labels")
        )


def parse_labels(values: list, path: Path, names: list[str], task: str) -> np.ndarray:
    """Labels as float32 (regression) or int64 classes (classification); the first bad one names its row."""
    numbers = np.empty(len(values), dtype=np.float64)
    for row, value in enumerate(values):
        try:
            numbers[row] = float(value) if value is not None and str(value).strip() != "" else np.nan
        except (TypeError, ValueError):
            numbers[row] = np.nan
        if not np.isfinite(numbers[row]):
            raise ConfigError(
                f"{path} row {row} (sequence {names[row]!r}): label {value!r} is not a number; the label column "
                "must hold a number for every sequence"
            )
    if task == "regression":
        return numbers.astype(np.float32)
    bad = np.flatnonzero((numbers != np.round(numbers)) | (numbers < 0))
    if bad.size:
        row = int(bad[0])
        raise ConfigError(
            f"{path} row {row} (sequence {names[row]!r}): label {values[row]!r} is not a class index; "
            "classification labels are integers 0, 1, ..., num_classes - 1"
        )
    return numbers.astype(np.int64)


def read_table_file(path: Path, fmt: str, sequence_column: str, label_column: str | None, task: str) -> RawRecords:
    columns = _column_names(path, fmt)
    _check_column(path, columns, sequence_column, "sequence_column")
    wanted = [sequence_column]
    if label_column is not None:
        _check_column(path, columns, label_column, "label_column")
        wanted.append(label_column)
    has_ids = ID_COLUMN in columns and ID_COLUMN not in wanted
    table = _read_columns(path, fmt, wanted + [ID_COLUMN] * has_ids)
    sequences = table.column(sequence_column).to_pylist()
    if not sequences:
        raise ConfigError(f"{path}: no rows (only a header); point the data path at a file with sequences")
    names = [f"{path.name}:{row}" for row in range(len(sequences))]
    if has_ids:
        names = [str(name) if name not in (None, "") else fallback
                 for name, fallback in zip(table.column(ID_COLUMN).to_pylist(), names)]  # fmt: skip
    labels = None
    if label_column is not None:
        labels = parse_labels(table.column(label_column).to_pylist(), path, names, task)
    return RawRecords(names, sequences, labels)


def read_records(path: Path, sequence_column: str, label_column: str | None, task: str) -> RawRecords:
    fmt = file_format(path)
    if fmt == "fasta":
        if label_column is not None:
            raise ConfigError(
                f"{path}: a FASTA file has no labels; fine-tuning reads a table (CSV, TSV or Parquet) with the "
                "columns sequence_column and label_column"
            )
        return read_fasta(path)
    return read_table_file(path, fmt, sequence_column, label_column, task)


# -------------------------------------------------------------------------------------------- validated tokens


@dataclass
class CodonSequences:
    """The kept sequences of one data source, tokenized: ``<CLS>`` codons ``<SEP>`` per row, in a flat array."""

    flat: np.ndarray  # uint8 token ids of all rows, one after another
    starts: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n] tokens per row, <CLS> and <SEP> included
    names: np.ndarray  # object [n] sequence ids
    labels: np.ndarray | None = None  # float32 or int64 [n]
    counts: dict = field(default_factory=dict)  # read, skipped, truncated

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, row: int) -> np.ndarray:
        start = self.starts[row]
        return self.flat[start : start + self.lengths[row]].astype(np.int64)


def read_sequences(
    path,
    sequence_column: str = "sequence",
    label_column: str | None = None,
    invalid_codon_policy: str = "error",
    max_codons: int | None = None,
    task: str = "mlm",
    key: str = "path",
) -> CodonSequences:
    """Read, validate, truncate and tokenize every sequence ``path`` names (see the module docstring).

    ``label_column`` is read when given (fine-tuning); ``task`` says how (``regression``: float, ``classification``:
    integer classes). ``key`` is the config key the path came from, for the messages.
    """
    if task not in TASKS:
        raise ConfigError(f"task must be one of {TASKS}, got {task!r}")
    if max_codons is not None and int(max_codons) < 1:
        raise ConfigError(f"max_codons must be a positive number of codons, got {max_codons}")
    files = data_files(path, key)
    pieces, lengths, names, labels = [], [], [], []
    n_read = n_skipped = n_truncated = 0
    for file in files:
        records = read_records(file, sequence_column, label_column, task)
        for row, (name, raw) in enumerate(zip(records.names, records.sequences)):
            try:
                cleaned = check_coding_sequence("" if raw is None else str(raw), invalid_codon_policy, name=name)
            except InvalidCodingSequence as error:
                raise ConfigError(f"{file}: {error}") from None
            except ValueError as error:  # an unknown policy
                raise ConfigError(str(error)) from None
            n_read += 1
            if cleaned is None:
                n_skipped += 1
                continue
            ids = encode(cleaned, max_codons=max_codons)
            n_truncated += int(max_codons is not None and -(-len(cleaned) // 3) > max_codons)
            pieces.append(ids.astype(np.uint8))
            lengths.append(ids.size)
            names.append(name)
            if records.labels is not None:
                labels.append(records.labels[row])
    source = str(path)
    if n_skipped or n_truncated:
        logger.warning(
            "%s: read %d sequences from %d file(s); skipped %d (invalid_codon_policy=%s), truncated %d to "
            "max_codons=%s",
            source, n_read, len(files), n_skipped, invalid_codon_policy, n_truncated, max_codons,
        )  # fmt: skip
    else:
        logger.info("%s: read %d sequences from %d file(s)", source, n_read, len(files))
    if not pieces:
        raise ConfigError(
            f"{key}={path}: no usable sequence ({n_read} read, {n_skipped} skipped as not whole clean codons)"
        )
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return CodonSequences(
        flat=np.concatenate(pieces),
        starts=starts,
        lengths=lengths,
        names=np.asarray(names, dtype=object),
        labels=None if label_column is None else np.asarray(labels, np.float32 if task == "regression" else np.int64),
        counts={"read": n_read, "skipped": n_skipped, "truncated": n_truncated},
    )


def split_rows(n_rows: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train_rows, val_rows)``, sorted: a seeded random ``val_fraction`` of the rows (at least one when the
    fraction is positive) is held out. The split depends only on ``n_rows`` and ``seed``, never on the world size."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(n_rows * val_fraction))
    n_val = max(n_val, 1) if val_fraction > 0 else 0
    if n_val >= n_rows:
        raise ConfigError(
            f"val_fraction={val_fraction} of {n_rows} sequences leaves none to train on; lower val_fraction or give "
            "a separate val_path"
        )
    order = np.random.default_rng(seed).permutation(n_rows)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


# ---------------------------------------------------------------------------------------------------- samples


class CodonSamples(torch.utils.data.Dataset):
    """Map-style view of a ``CodonSequences``, indexed by ``(epoch, row)`` pairs (``epoch_batch_sampler.py``).

    A sample is ``{"input_ids", "epoch", "sample_index": row}``, plus ``"label"`` when the data has labels and
    ``"name"`` with ``with_names`` (prediction)."""

    def __init__(self, data: CodonSequences, with_names: bool = False):
        self.data = data
        self.with_names = with_names

    def __len__(self) -> int:
        return len(self.data)

    def sample(self, epoch: int, row: int) -> dict:
        sample = {"input_ids": self.data.tokens(row), "epoch": int(epoch), "sample_index": int(row)}
        if self.data.labels is not None:
            sample["label"] = self.data.labels[row].item()
        if self.with_names:
            sample["name"] = str(self.data.names[row])
        return sample

    def __getitems__(self, keys):
        return [self.sample(*key) if isinstance(key, tuple | list) else self.sample(0, key) for key in keys]

    def __getitem__(self, key):
        return self.__getitems__([key])[0]
