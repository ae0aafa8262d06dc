"""Streaming DNA for causal-LM pre-training: read shards lazily, cut windows, pack, split per rank, resume exactly.

``create_dataloader(data_cfg, tokenizer, dp_rank, dp_world_size, seed)`` is the training entry point (an endless,
resumable ``StatefulDataLoader``); ``validation_batches(...)`` makes one finite pass over a held-out file and
``held_out_batches(...)`` hands that pass to ``validation.Validator``. ``data_cfg`` holds the keys of the ``dataset:`` group in ``hydra_config/defaults.yaml``; unknown keys are an error.

Sources (a file, a directory or a glob): JSON lines (``.jsonl``/``.jsonl.gz``, the sequence under
``sequence_column``, OpenGenome2's layout), FASTA (``.fa``/``.fasta``/``.fna``, optionally ``.gz``) and Parquet
(e.g. the globally shuffled shards of ``scripts/reshard_to_parquet.py``). Nothing is loaded whole: files are read
record by record (Parquet one row group at a time), and only the current record's tokens are held.

Who reads what: with at least as many files as data-parallel ranks, rank r reads files r, r + n, r + 2n, ... (no
rank touches another's files); with fewer files, every rank reads every file and keeps records r, r + n, ... of
each. Each rank walks its files in a new seeded order every epoch and starts the next epoch when done, so the stream
never ends. Within a file the order is the file's own: shuffle globally with the reshard script.

Resume: the state is a cursor to the next unread token (epoch, file, record, window, offset into that window), so a
resumed run re-opens one file, skips to the record (JSONL lines are skipped unparsed, Parquet row groups by their
metadata) and continues at the same token, also in the middle of a window that packing split over two batches.
A run resumed on another number of data-parallel ranks first reads what the old ranks had left of their passes
(each from its cursor on), dealt out to the new ranks file by file, and then starts new passes
(``GenomicStream.continue_from``, called by ``checkpoint.Checkpointer``).
"""

import glob
import gzip
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from collator import LabelMaker, collate_bshd, collate_thd, pad_token_id
from context_parallel import context_parallel_batch
from data_resume import dataset_state_in, states_by_dp_rank
from sequence_windows import sequence_windows
from stream_order import Cursor, PassOrder, Unit, in_last_window, moved_position
from torchdata.stateful_dataloader import StatefulDataLoader
from user_errors import ConfigError, PathNotFoundError
from validation import HeldOutBatches


logger = logging.getLogger(__name__)

FASTA_SUFFIXES = (".fa", ".fasta", ".fna")
FORMATS = ("jsonl", "fasta", "parquet")
DEFAULTS = {
    "path": None,
    "format": "auto",
    "sequence_column": "text",
    "max_seq_length": 8192,
    "window_overlap": 200,
    "input_format": "thd",
    "micro_batch_size": 1,
    "token_budget": 8192,
    "split_samples": True,
    "uppercase_labels": True,
    "mask_degenerate_bases": True,
    "shuffle_files": True,
    "num_workers": 1,
}
# Written by reshard_to_parquet.py --chunk-length: whether a row begins / ends its original sequence, so that
# <bos>/<eos> still mark only true sequence boundaries.
START_COLUMN, END_COLUMN = "seq_start", "seq_end"
# What a saved cursor means, beside the files and the seed: in what order files and records are read, and how records
# are cut into windows. A cursor moves to other window settings (it names a token of a record); not to another order.
ORDER_KEYS = ("format", "sequence_column", "shuffle_files")
GEOMETRY_KEYS = ("max_seq_length", "window_overlap")
WINDOW_KEYS = (*ORDER_KEYS, *GEOMETRY_KEYS)


# ------------------------------------------------------------------------------------------------ reading files


@dataclass(frozen=True)
class Record:
    text: str
    starts_sequence: bool = True
    ends_sequence: bool = True


def file_format(file: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    name = file.name.lower().removesuffix(".gz")
    if name.endswith(FASTA_SUFFIXES):
        return "fasta"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".jsonl"):  # not .json: a directory of shards may hold a manifest.json
        return "jsonl"
    raise ConfigError(f"cannot tell the format of {file}; name it .jsonl[.gz], .fa/.fasta/.fna[.gz] or .parquet")


def resolve_files(path: str, fmt: str = "auto", key: str = "dataset.path") -> list[Path]:
    """The data files a path names, sorted; a directory contributes the files whose format its names give away.
    ``key``: the config key that gave the path, for the error message."""
    if any(ch in path for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(path) if Path(p).is_file())
    elif Path(path).is_dir():
        files = []
        for candidate in sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith(".")):
            try:  # by name, so a manifest.json or README beside Parquet shards is not read as one
                kind = file_format(candidate)
            except ValueError:
                continue
            if fmt in ("auto", kind):
                files.append(candidate)
    elif Path(path).is_file():
        files = [Path(path)]
    else:
        raise PathNotFoundError(f"{key} {path!r} does not exist; point {key} at a file, directory or glob")
    if not files:
        raise PathNotFoundError(
            f"{key} {path!r} names no data files; give .jsonl[.gz], .fa/.fasta/.fna[.gz] or .parquet files"
        )
    return files


def _open_text(file: Path):
    return gzip.open(file, "rt") if file.name.endswith(".gz") else open(file)


def iter_fasta(file: Path) -> Iterator[tuple[str, str]]:
    """(header, sequence) pairs, one record in memory at a time; line breaks inside a sequence are dropped."""
    name, chunks = None, []
    with _open_text(file) as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if line.startswith(">"):
                if name is not None:
                    yield name, "".join(chunks)
                name, chunks = line[1:].strip(), []
            elif line:
                if name is None:
                    raise ConfigError(f"{file}:{number}: sequence data before the first '>' header; not FASTA")
                chunks.append(line)
    if name is not None:
        yield name, "".join(chunks)


def _jsonl_records(file: Path, column: str, skip: int, keep) -> Iterator[tuple[int, Record]]:
    index = -1
    with _open_text(file) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            index += 1
            if index < skip or not keep(index):  # skipped lines are never parsed: resuming is cheap
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{file}:{number}: not a JSON object ({error.msg}); malformed JSONL") from None
            if not isinstance(record, dict) or not isinstance(record.get(column), str):
                raise ConfigError(f"{file}:{number}: no string under key {column!r}; set dataset.sequence_column")
            yield index, Record(record[column])


def _parquet_records(file: Path, column: str, skip: int, keep) -> Iterator[tuple[int, Record]]:
    parquet = pq.ParquetFile(file)
    names = parquet.schema_arrow.names
    if column not in names:
        raise ConfigError(f"{file} has no column {column!r} (columns: {names}); set dataset.sequence_column")
    flags = [name for name in (START_COLUMN, END_COLUMN) if name in names]
    first = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows > skip:  # row groups wholly before the resume point are never read
            table = parquet.read_row_group(group, columns=[column, *flags]).to_pydict()
            for row, text in enumerate(table[column]):
                if first + row < skip or not keep(first + row):
                    continue
                if not isinstance(text, str):
                    raise ConfigError(f"{file}: row {first + row} of column {column!r} is not a string")
                ends = [table[name][row] if name in table else True for name in (START_COLUMN, END_COLUMN)]
                yield first + row, Record(text, *ends)
        first += rows


def iter_records(
    file: Path, fmt: str = "auto", column: str = "text", skip: int = 0, keep=lambda index: True
) -> Iterator[tuple[int, Record]]:
    """(index in file, record) for the records from ``skip`` on that ``keep(index)`` accepts."""
    kind = file_format(file, fmt)
    try:
        if kind == "jsonl":
            yield from _jsonl_records(file, column, skip, keep)
        elif kind == "parquet":
            yield from _parquet_records(file, column, skip, keep)
        else:
            for index, (_, sequence) in enumerate(iter_fasta(file)):
                if index >= skip and keep(index):
                    yield index, Record(sequence)
    except GeneratorExit:  # the stream closed early (also at interpreter exit, when pa's names may be gone already)
        raise
    except (OSError, EOFError, UnicodeDecodeError, pa.ArrowException) as error:  # truncated gzip, not Parquet, ...
        raise ConfigError(
            f"{file}: cannot be read as {kind} ({error}); check the file or its name's suffix"
        ) from error


# ------------------------------------------------------------------------------------------------ the stream


class GenomicStream(torch.utils.data.IterableDataset):
    """Batches for one data-parallel rank: endless and resumable for training, or one ordered pass (validation)."""

    def __init__(
        self, files, tokenizer, cfg: dict, dp_rank: int, dp_world_size: int, seed: int, endless=True, cp_size: int = 1
    ):
        self.cfg, self.seed, self.endless, self.cp_size = cfg, seed, endless, cp_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.all_files = list(files)
        self.order = PassOrder(len(files), seed, shuffle=endless and cfg["shuffle_files"])
        self.by_file = len(files) >= dp_world_size
        self.files = list(files[dp_rank::dp_world_size]) if self.by_file else list(files)
        self.tokenizer = tokenizer
        self.token_dtype = np.uint8 if len(tokenizer) <= 256 else np.int32
        self.labels = LabelMaker(tokenizer, cfg["uppercase_labels"], cfg["mask_degenerate_bases"])
        self.pad_token_id = pad_token_id(tokenizer)
        self.cursor, self.batches = Cursor(), 0
        # After a resume on another number of ranks (``continue_from``): the old ranks' leftover pass (stream_order.py).
        self.leftover: list[Unit] = []
        self.first_epoch = 0

    def _my_units(self, epoch: int) -> list[Unit]:
        return self.order.units(epoch, self.dp_rank, self.dp_world_size, self.leftover, self.first_epoch)

    def _stride(self) -> int:
        return self.cfg["max_seq_length"] - self.cfg["window_overlap"]

    def _windows_of(self, record: Record) -> list[np.ndarray]:
        ids = self.tokenizer(record.text, add_special_tokens=False)["input_ids"]
        return sequence_windows(
            np.asarray(ids, dtype=self.token_dtype),
            self.cfg["max_seq_length"],
            self.cfg["window_overlap"],
            self.tokenizer.bos_token_id if record.starts_sequence else None,
            self.tokenizer.eos_token_id if record.ends_sequence else None,
        )

    def _windows(self, start: Cursor) -> Iterator[tuple[Cursor, np.ndarray]]:
        """Every window from ``start`` on, with the cursor of its first token (what precedes ``start`` is dropped)."""
        epoch = start.epoch
        while True:
            found = False
            for file_pos, unit in enumerate(self._my_units(epoch)):
                if (epoch, file_pos) < (start.epoch, start.file):
                    continue
                begin = unit.start()
                if (epoch, file_pos) == (start.epoch, start.file):
                    begin = max(begin, (start.record, start.window, start.offset))
                for index, record in iter_records(
                    self.all_files[unit.file], self.cfg["format"], self.cfg["sequence_column"], begin[0], unit.keeps
                ):
                    if not record.text:
                        continue
                    found = True
                    windows = self._windows_of(record)
                    if index == begin[0] and begin[1] >= len(windows):
                        begin = in_last_window(begin, len(windows), self._stride())
                    for number, window in enumerate(windows):
                        if (index, number) < begin[:2]:
                            continue
                        offset = begin[2] if (index, number) == begin[:2] else 0
                        if offset < len(window):
                            yield Cursor(epoch, file_pos, index, number, offset), window[offset:]
            if not self.endless:
                return
            # Not resumed part-way through it, and not a leftover pass (which may hold nothing for this rank).
            whole_epoch = (epoch > start.epoch or start == Cursor(epoch=epoch)) and epoch >= self.first_epoch
            if whole_epoch and not found and self.dp_world_size == 1:
                names = ", ".join(str(file) for file in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
                raise ConfigError(f"{names}: no sequences (empty files?); point dataset.path at files with sequences")
            if whole_epoch and not found:
                raise ConfigError(
                    f"data-parallel rank {self.dp_rank} of {self.dp_world_size} gets no sequences from "
                    f"{len(self.files)} file(s); use more data or fewer ranks"
                )
            epoch += 1

    def _thd_groups(self, windows) -> Iterator[tuple[list[np.ndarray], Cursor | None]]:
        budget, split = self.cfg["token_budget"], self.cfg["split_samples"]
        pieces, used = [], 0
        for cursor, window in windows:
            start = 0
            while start < len(window):
                if len(window) - start > budget - used and not split:
                    yield (
                        pieces,
                        replace(cursor, offset=cursor.offset + start),
                    )  # the whole window starts the next batch
                    pieces, used = [], 0
                take = min(budget - used, len(window) - start)
                pieces.append(window[start : start + take])
                used, start = used + take, start + take
                if used == budget:
                    yield pieces, replace(cursor, offset=cursor.offset + start)
                    pieces, used = [], 0
        if pieces:  # only a finite stream ends: its last batch may be short
            yield pieces, None

    def _bshd_groups(self, windows) -> Iterator[tuple[list[np.ndarray], Cursor | None]]:
        group = []
        for cursor, window in windows:
            group.append(window)
            if len(group) == self.cfg["micro_batch_size"]:
                yield group, replace(cursor, offset=cursor.offset + len(window))
                group = []
        if group:
            yield group, None

    def __iter__(self):
        windows = self._windows(self.cursor)
        if self.cfg["input_format"] == "thd":
            for pieces, cursor in self._thd_groups(windows):
                self.cursor, self.batches = (
                    cursor or self.cursor,
                    self.batches + 1,
                )  # state first: it counts this batch
                batch = collate_thd(pieces, self.labels, self.cfg["max_seq_length"])
                yield batch if self.cp_size == 1 else context_parallel_batch(batch, self.cp_size, self.pad_token_id)
        else:
            for group, cursor in self._bshd_groups(windows):
                self.cursor, self.batches = cursor or self.cursor, self.batches + 1
                yield collate_bshd(group, self.labels, self.pad_token_id)

    # ---- resume: the same world restores the cursor; another world finishes the old ranks' passes (continue_from)

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": asdict(self.cursor),
            "batches": self.batches,
            "num_files": len(self.files),
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "leftover": [asdict(unit) for unit in self.leftover],
            "first_epoch": self.first_epoch,
            # What it takes to read another rank's stream: which files, and how records become windows.
            "num_files_total": len(self.all_files),
            **{key: self.cfg[key] for key in WINDOW_KEYS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_files"] != len(self.files):
            raise ConfigError(
                f"the data state was saved for {state['num_files']} file(s) on this rank, the dataset now has "
                f"{len(self.files)}: the cursor would point elsewhere. Keep dataset.path unchanged to resume"
            )
        self.cursor, self.batches = Cursor(**state["cursor"]), int(state["batches"])
        self.leftover = [Unit(**unit) for unit in state.get("leftover", [])]
        self.first_epoch = int(state.get("first_epoch", 0))

    position_in = staticmethod(dataset_state_in)  # this dataset's state inside a StatefulDataLoader state

    def reads_like(self, state: dict) -> bool:
        """Whether ``state`` is this DP rank's own stream with this run's windows, which its cursor alone restores
        (states older than these keys are taken to be). The batch shape may change: the cursor points at a token, not
        a batch. Other window settings (e.g. a longer ``max_seq_length``) go through ``continue_from``, which moves
        the cursors to the new windows."""
        here = {"dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size}
        here.update({key: self.cfg[key] for key in WINDOW_KEYS})
        return all(state.get(key, value) == value for key, value in here.items())

    def continue_from(self, states: list[dict]) -> str:
        """Go on where the DP ranks of an earlier world stopped (``states``: every one of their ranks' states; the
        CP ranks of one DP group hold equal ones); returns what it did, for the log.

        What each old rank had left of its current pass (the rest of the file it was in, from its cursor's token on,
        and the files after it) becomes this world's leftover pass, dealt out unit by unit to the new ranks; then
        every new rank starts its own passes over its share of the files, at an epoch after all of the old ones.
        No token is read twice in a pass, and none is skipped.

        The same happens on the same ranks with other ``max_seq_length`` or ``window_overlap``: every position names
        a token of a record, which the new windows hold too.

        Raises ``ValueError`` when ``states`` cannot describe that world (an older format, ranks missing or
        disagreeing, other files or another order): the caller then starts the data afresh.
        """
        needed = ("cursor", "leftover", "first_epoch", "num_files_total", *WINDOW_KEYS)
        old_world, by_rank = states_by_dp_rank(states, needed)
        reading_now = {"num_files_total": len(self.all_files)} | {key: self.cfg[key] for key in ORDER_KEYS}
        if any(s[key] != value for s in by_rank.values() for key, value in reading_now.items()):
            raise ValueError(f"it was reading other files or in another order (this run's: {reading_now})")
        if any(
            (s["leftover"], s["first_epoch"], *(s[key] for key in GEOMETRY_KEYS))
            != (states[0]["leftover"], states[0]["first_epoch"], *(states[0][key] for key in GEOMETRY_KEYS))
            for s in states
        ):
            raise ValueError("its ranks disagree on the earlier worlds of the run")
        # Positions name a token by (record, window, offset); other window settings here move them to this run's.
        same_windows = all(states[0][key] == self.cfg[key] for key in GEOMETRY_KEYS)
        old_stride = int(states[0]["max_seq_length"]) - int(states[0]["window_overlap"])

        def moved(unit: Unit, at: tuple[int, int, int]) -> Unit:
            record, window, offset = at if same_windows else moved_position(at, old_stride, self._stride())
            return replace(unit, record=record, window=window, offset=offset)

        old_leftover, old_first = [Unit(**unit) for unit in states[0]["leftover"]], int(states[0]["first_epoch"])
        leftover, begun = [], 0
        for rank in range(old_world):
            cursor = Cursor(**by_rank[rank]["cursor"])
            units = self.order.units(cursor.epoch, rank, old_world, old_leftover, old_first)[cursor.file :]
            if units:
                at = max(units[0].start(), (cursor.record, cursor.window, cursor.offset))
                begun += at != (0, 0, 0)
                leftover += [moved(units[0], at), *(moved(unit, unit.start()) for unit in units[1:])]
        self.leftover = leftover
        self.first_epoch = max(Cursor(**s["cursor"]).epoch for s in states) + 1
        self.cursor, self.batches = Cursor(epoch=self.first_epoch - 1), 0
        return (
            f"data: {old_world} DP ranks had {len(leftover)} file(s) of their current passes left ({begun} begun); "
            f"they are dealt out to {self.dp_world_size} DP rank(s), whose own passes over their files follow "
            f"(epoch {self.first_epoch} on)"
        )


# ------------------------------------------------------------------------------------------------ entry points


def validate_data_config(data_cfg: Any) -> dict:
    """The ``dataset`` config as a plain dict with defaults filled in; unknown keys and bad values are errors."""
    cfg = dict(data_cfg)
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown dataset config keys {unknown}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **cfg}
    if not cfg["path"]:
        raise ConfigError("dataset.path is required")
    if cfg["format"] not in ("auto", *FORMATS):
        raise ConfigError(f"dataset.format must be auto, jsonl, fasta or parquet, got {cfg['format']!r}")
    if cfg["input_format"] not in ("thd", "bshd"):
        raise ConfigError(f"dataset.input_format must be thd or bshd, got {cfg['input_format']!r}")
    if cfg["max_seq_length"] < 2:
        raise ConfigError(f"dataset.max_seq_length must be at least 2, got {cfg['max_seq_length']}")
    if not 0 <= cfg["window_overlap"] < cfg["max_seq_length"]:
        raise ConfigError(
            f"dataset.window_overlap must be in [0, max_seq_length={cfg['max_seq_length']}), got {cfg['window_overlap']}"
        )
    if cfg["micro_batch_size"] < 1 or cfg["token_budget"] < 1:
        raise ConfigError("dataset.micro_batch_size and dataset.token_budget must be positive")
    if cfg["input_format"] == "thd" and not cfg["split_samples"] and cfg["token_budget"] < cfg["max_seq_length"]:
        raise ConfigError("without split_samples, token_budget must hold a whole window (>= max_seq_length)")
    if cfg["num_workers"] not in (0, 1):
        raise ConfigError("dataset.num_workers must be 0 or 1 (one stateful stream per rank)")
    return cfg


def create_dataloader(
    data_cfg: Any, tokenizer, dp_rank: int = 0, dp_world_size: int = 1, seed: int = 42, cp_size: int = 1
):
    """A ``StatefulDataLoader`` over this rank's endless stream; its ``state_dict()`` resumes it exactly.

    With ``cp_size > 1`` it yields full context-parallel batches (``context_parallel.py``); the ranks of a CP group
    read the same ones (same ``dp_rank``) and each keeps its own shard.
    """
    cfg = validate_data_config(data_cfg)
    if cp_size > 1 and cfg["input_format"] != "thd":
        raise ConfigError(f"context parallelism (cp_size={cp_size}) needs dataset.input_format=thd")
    files = resolve_files(str(cfg["path"]), cfg["format"])
    dataset = GenomicStream(files, tokenizer, cfg, dp_rank, dp_world_size, seed, cp_size=cp_size)
    logger.info(
        "Data: %d file(s) under %s; rank %d reads %s; windows of <= %d tokens overlapping by %d",
        len(files),
        cfg["path"],
        dp_rank,
        f"{len(dataset.files)} of them" if dataset.by_file else f"every {dp_world_size}-th record of each",
        cfg["max_seq_length"],
        cfg["window_overlap"],
    )
    with warnings.catch_warnings():
        # torchdata calls torch.set_vital, which torch 2.13 deprecates: a warning in every run that no user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            dataset,
            batch_size=None,
            num_workers=cfg["num_workers"],
            pin_memory=torch.cuda.is_available(),
            persistent_workers=cfg["num_workers"] > 0,
        )


def validation_batches(
    data_cfg: Any, tokenizer, path: str, dp_rank: int = 0, dp_world_size: int = 1, max_batches: int | None = None
) -> Iterator[dict]:
    """One pass, in file order, over this rank's part of ``path`` with the training windows and labels.

    Windows are never split over two batches here (a split window's tail would lose its context and the score of its
    first token), so every window is scored exactly as a model sees it alone. The format comes from the file names:
    a held-out JSONL file may well sit beside Parquet training shards.
    """
    cfg = {**dict(data_cfg), "path": path, "format": "auto", "num_workers": 0, "split_samples": False}
    cfg["token_budget"] = max(
        cfg.get("token_budget", DEFAULTS["token_budget"]), cfg.get("max_seq_length", DEFAULTS["max_seq_length"])
    )
    cfg = validate_data_config(cfg)
    stream = GenomicStream(
        resolve_files(path, cfg["format"]), tokenizer, cfg, dp_rank, dp_world_size, 0, endless=False
    )
    return islice(iter(stream), max_batches)


def held_out_batches(
    path: str, data_cfg: Any, tokenizer, dp_rank: int = 0, dp_world_size: int = 1, cp_size: int = 1
) -> HeldOutBatches:
    """This rank's validation pass over ``path`` for ``validation.Validator``: ``validation_batches`` read anew at
    every evaluation (nothing is held between them), as full context-parallel batches when ``cp_size > 1``.

    The files are resolved here, so a missing ``validation.path`` stops the run before it trains.
    """
    files = resolve_files(path, key="validation.path")
    pad = pad_token_id(tokenizer)

    def read() -> Iterator[dict]:
        for batch in validation_batches(data_cfg, tokenizer, path, dp_rank, dp_world_size):
            yield batch if cp_size == 1 else context_parallel_batch(batch, cp_size, pad)

    # <bos><eos>, nothing scored: what a rank without validation windows runs so that collectives line up.
    ids = torch.tensor([[tokenizer.bos_token_id, tokenizer.eos_token_id]])
    boundaries = torch.tensor([0, 2], dtype=torch.int32)
    placeholder = {
        "input_ids": ids,
        "labels": torch.full_like(ids, -100),
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries.clone(),
    }
    if cp_size > 1:
        placeholder = context_parallel_batch(placeholder, cp_size, pad)
    return HeldOutBatches(
        read,
        placeholder,
        causal_lm=True,
        description=f"{len(files)} file(s) under {path}, read in file order; data-parallel rank {dp_rank} of "
        f"{dp_world_size} scores its share",
    )
