"""DNA sequences for Llama causal-LM pre-training: read, tokenize, cut into windows, split per rank, batch, resume.

``create_dataloader(data_cfg, tokenizer, dp_rank, dp_world_size, seed)`` is the entry point; ``data_cfg`` holds the
keys of the ``dataset:`` group in ``hydra_config/defaults.yaml`` (unknown keys are an error). ``held_out_batches``
gives ``validation.Validator`` the batches of a held-out file, windowed and labelled the same way.

Sources: FASTA (``.fa``, ``.fasta``, ``.fna``, optionally ``.gz``), Parquet, or JSON lines (``.jsonl``, ``.jsonl.gz``)
with the sequence in ``sequence_column``; a path may be a file, a directory or a glob. Every sequence is tokenized
once (``<bos>`` + bases + ``<eos>``) and cut into windows of ``max_seq_length`` tokens that overlap by
``window_overlap`` tokens (see ``sequence_windows.window_starts``). The recipe keeps the tokens in memory (one byte per
base): fine for the benchmark and sanity data; stream a larger corpus through your own loader.

Order (``window_order.WindowOrder``): every epoch permutes all windows with ``[seed, epoch]``; rank ``r`` of ``n``
takes every n-th window of that permutation. The stream never ends (epochs follow each other), so every rank can
take any number of steps.

Resume: the dataset's state is the number of batches it has produced. Everything else is a pure function of the
seed, so loading that number and replaying the index arithmetic (no tokenization) restarts at the same token,
including the tail of a window that packing split over two batches. A run resumed on another number of
data-parallel ranks (or with another batch shape) replays every old rank's stream to where it stopped and deals the
windows of that epoch that none of them had started out to the new ranks (``GenomicBatches.continue_from``, called
by ``checkpoint.Checkpointer``).
"""

import glob
import gzip
import json
import logging
import warnings
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from collator import LabelMaker, collate_bshd, collate_thd, pack_windows, pad_token_id
from context_parallel import context_parallel_batch
from data_resume import dataset_state_in, states_by_dp_rank
from sequence_windows import window_starts
from torchdata.stateful_dataloader import StatefulDataLoader
from user_errors import ConfigError, PathNotFoundError
from validation import HeldOutBatches
from window_order import WindowOrder


logger = logging.getLogger(__name__)

FASTA_SUFFIXES = (".fa", ".fasta", ".fna")
DEFAULTS = {
    "path": None,
    "format": "auto",  # auto | fasta | parquet | jsonl
    "sequence_column": "sequence",
    "max_seq_length": 8192,
    "window_overlap": 0,
    "input_format": "thd",  # thd | bshd
    "micro_batch_size": 1,
    "token_budget": 8192,
    "split_samples": True,
    "uppercase_labels": True,
    "mask_degenerate_bases": True,
    "strip_whitespace": True,
    "shuffle": True,
    "num_workers": 1,
}
# What a saved data position means: with the data and the seed, which windows are read in what order, and how
# batches take them (a resume replays the old ranks' streams with these).
WINDOW_KEYS = ("max_seq_length", "window_overlap", "shuffle")
BATCH_SHAPE_KEYS = ("input_format", "token_budget", "split_samples", "micro_batch_size")


# ---------------------------------------------------------------------------------------------- reading sources


def _resolve_files(path: str, key: str = "dataset.path") -> list[Path]:
    if any(ch in path for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(path))
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith("."))
    else:
        files = [Path(path)]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise PathNotFoundError(
            f"{key}={path!r}: no such file(s): {missing or path}; point {key} at a FASTA, Parquet or JSONL file, a "
            "directory or a glob"
        )
    return files


def _format_fix(key: str) -> str:
    """How to tell the reader a file's format: the training data has dataset.format; held-out files go by their name."""
    if key == "dataset.path":
        return "set dataset.format to fasta, parquet or jsonl"
    return "name it .fa/.fasta/.fna, .parquet or .jsonl (optionally .gz): its format is read from the name"


def _file_format(file: Path, fmt: str, key: str = "dataset.path") -> str:
    if fmt != "auto":
        return fmt
    name = file.name.lower().removesuffix(".gz")
    if name.endswith(FASTA_SUFFIXES):
        return "fasta"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    raise ConfigError(f"cannot tell the format of {file}; {_format_fix(key)}")


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


def _read_fasta(file: Path) -> list[str]:
    return [sequence for _, sequence in iter_fasta(file)]


def _read_column(file: Path, fmt: str, column: str) -> list[str]:
    if fmt == "parquet":
        table = pq.read_table(file)
        if column not in table.column_names:
            raise ConfigError(f"{file} has no column {column!r} (columns: {table.column_names}); set sequence_column")
        return table.column(column).to_pylist()
    sequences = []
    with _open_text(file) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{file}:{number}: not a JSON object ({error.msg}); malformed JSONL") from None
            if not isinstance(record, dict) or column not in record:
                raise ConfigError(f"{file}:{number} has no key {column!r}; set dataset.sequence_column")
            sequences.append(record[column])
    return sequences


def read_sequences(
    path: str,
    fmt: str = "auto",
    sequence_column: str = "sequence",
    strip_whitespace: bool = True,
    key: str = "dataset.path",
) -> list[str]:
    """Every sequence in ``path`` (file, directory or glob); empty sequences are an error.

    ``strip_whitespace`` removes line breaks and spaces inside a sequence (DNA); keep it off for natural language.
    ``key`` is the config key that gave the path, for error messages.
    """
    if fmt not in ("auto", "fasta", "parquet", "jsonl"):
        raise ConfigError(f"dataset.format must be auto, fasta, parquet or jsonl, got {fmt!r}")
    sequences = []
    for file in _resolve_files(path, key):
        kind = _file_format(file, fmt, key)
        try:
            found = _read_fasta(file) if kind == "fasta" else _read_column(file, kind, sequence_column)
        except (OSError, EOFError, UnicodeDecodeError, pa.ArrowException) as error:  # truncated gzip, not Parquet, ...
            raise ConfigError(
                f"{file}: cannot be read as {kind} ({error}); check the file, or {_format_fix(key)}"
            ) from None
        for index, sequence in enumerate(found):
            if not isinstance(sequence, str) or not sequence.strip():
                raise ConfigError(
                    f"{file}: sequence {index} is empty or not a string; fix the file or dataset.sequence_column"
                )
        sequences += ["".join(s.split()) for s in found] if strip_whitespace else found
    if not sequences:
        raise ConfigError(f"{key}={path!r} holds no sequences (empty files?); point it at files with sequences")
    return sequences


# ---------------------------------------------------------------------------------------------- windows and batches


def tokenize(sequences: list[str], tokenizer) -> list[np.ndarray]:
    """``<bos>`` + bases + ``<eos>`` per sequence, as uint8 arrays when the vocabulary allows (it does for DNA)."""
    dtype = np.uint8 if len(tokenizer) <= 256 else np.int32
    encoded = tokenizer(sequences, add_special_tokens=False)["input_ids"]
    return [np.array([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], dtype=dtype) for ids in encoded]


class GenomicBatches(torch.utils.data.IterableDataset):
    """An endless, resumable stream of training batches for one data-parallel rank."""

    def __init__(
        self,
        tokens: list[np.ndarray],
        tokenizer,
        cfg: dict,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        cp_size: int = 1,
    ):
        self.tokens, self.cfg, self.seed, self.cp_size = tokens, cfg, seed, cp_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        # The tokens already hold <bos>/<eos>, so these are sequence_windows' windows, kept as (sequence, offset)
        # pairs: nothing is copied until a window is used, and resuming replays only this index arithmetic.
        self.windows = [
            (index, start)
            for index, seq in enumerate(tokens)
            for start in window_starts(len(seq), cfg["max_seq_length"], cfg["window_overlap"])
        ]
        if len(self.windows) < dp_world_size:
            raise ConfigError(
                f"{len(self.windows)} windows cannot be split over {dp_world_size} data-parallel ranks; use more data "
                "or fewer ranks"
            )
        self.order = WindowOrder(len(self.windows), seed, cfg["shuffle"])
        self.labels = LabelMaker(tokenizer, cfg["uppercase_labels"], cfg["mask_degenerate_bases"])
        self.pad_token_id = pad_token_id(tokenizer)
        self.batches_done = 0  # batches this world's stream has produced: with the history, the resumable state
        self.history: list[dict] = []  # the run's earlier worlds (window_order.WindowOrder), oldest first

    def _window(self, position: int) -> np.ndarray:
        index, start = self.windows[position]
        return self.tokens[index][start : start + self.cfg["max_seq_length"]]

    def _window_stream(self, dp_rank: int, dp_world_size: int, history: list[dict]) -> Iterator[np.ndarray]:
        return (self._window(position) for _, _, position in self.order.stream(dp_rank, dp_world_size, history))

    def _batch_stream(self):
        windows = self._window_stream(self.dp_rank, self.dp_world_size, self.history)
        if self.cfg["input_format"] == "thd":
            for pieces in pack_windows(windows, self.cfg["token_budget"], self.cfg["split_samples"]):
                yield lambda pieces=pieces: self._thd_batch(pieces)
        else:
            while True:
                group = [next(windows) for _ in range(self.cfg["micro_batch_size"])]
                yield lambda group=group: collate_bshd(group, self.labels, self.pad_token_id)

    def _thd_batch(self, pieces: list[np.ndarray]) -> dict:
        batch = collate_thd(pieces, self.labels, self.cfg["max_seq_length"])
        return batch if self.cp_size == 1 else context_parallel_batch(batch, self.cp_size, self.pad_token_id)

    def __iter__(self):
        skip = self.batches_done
        for number, make_batch in enumerate(self._batch_stream()):
            if number < skip:  # replay to the resumed position without building those batches
                continue
            self.batches_done = number + 1
            yield make_batch()

    # ---- resume: the same world restores ``batches_done``; another world continues the epoch (``continue_from``)

    def state_dict(self) -> dict:
        return {
            "batches_done": self.batches_done,
            "history": [dict(world) for world in self.history],
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            # What it takes to replay this stream elsewhere: which windows there are and how batches take them.
            **{key: self.cfg[key] for key in (*WINDOW_KEYS, *BATCH_SHAPE_KEYS)},
            "num_windows": len(self.windows),
        }

    def load_state_dict(self, state: dict) -> None:
        self.batches_done = int(state["batches_done"])
        self.history = list(state.get("history", []))

    position_in = staticmethod(dataset_state_in)  # this dataset's state inside a StatefulDataLoader state

    def reads_like(self, state: dict) -> bool:
        """Whether ``state`` is this DP rank's own stream (same world, windows and batch shape) that ``batches_done``
        alone restores; states older than these keys are taken to be. Other windows (``max_seq_length``,
        ``window_overlap``, ``shuffle``, or other data: another number of windows) are another window list, which
        ``continue_from`` refuses: the data starts afresh, with a warning, rather than replaying a count of batches
        over windows it did not count."""
        here = {"dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "num_windows": len(self.windows)}
        here.update({key: self.cfg[key] for key in (*WINDOW_KEYS, *BATCH_SHAPE_KEYS)})
        return all(state.get(key, value) == value for key, value in here.items())

    def continue_from(self, states: list[dict]) -> str:
        """Go on where the DP ranks of an earlier world stopped (``states``: every one of their ranks' states; the
        CP ranks of one DP group hold equal ones), reading the windows of their epoch that none of them had started;
        returns what it did, for the log. Also for the same number of ranks with another ``token_budget``,
        ``micro_batch_size``, ``input_format`` or ``split_samples``: the old ranks' positions are replayed with
        the batch shape they had.

        Raises ``ValueError`` when ``states`` cannot describe that world (an older format, ranks missing or
        disagreeing, other windows): the caller then starts the data afresh.
        """
        needed = ("history", "num_windows", *WINDOW_KEYS, *BATCH_SHAPE_KEYS)
        old_world, by_rank = states_by_dp_rank(states, needed)
        windows_now = {"num_windows": len(self.windows)} | {k: self.cfg[k] for k in WINDOW_KEYS}
        for s in by_rank.values():
            if any(s.get(key) != value for key, value in windows_now.items()):
                raise ValueError(f"it was reading other windows (this run's: {windows_now})")
        history = by_rank[0]["history"]
        if any(s["history"] != history for s in by_rank.values()):
            raise ValueError("its ranks disagree on the earlier worlds of the run")

        positions = [self._position_of(by_rank[rank], history) for rank in range(old_world)]
        self.history = [*history, {"dp_world_size": old_world, "positions": positions}]
        self.batches_done = 0
        epoch = self.order.first_epoch(self.history)
        unread = len(self.order.unread(epoch, self.history))
        return (
            f"data: {old_world} DP ranks had started {len(self.windows) - unread} of epoch {epoch}'s "
            f"{len(self.windows)} windows; the other {unread} are dealt out to {self.dp_world_size} DP rank(s) (the "
            "unread tail of a window split over two batches is skipped)"
        )

    def _position_of(self, state: dict, history: list[dict]) -> list[int]:
        """``[epoch, windows started in it]`` of the DP rank that saved ``state``: its batches replayed by index
        arithmetic with the batch shape it had (no batch is built)."""
        rank, world, batches = int(state["dp_rank"]), int(state["dp_world_size"]), int(state["batches_done"])
        if state["input_format"] != "thd":
            started = batches * int(state["micro_batch_size"])
        else:
            windows = self._window_stream(rank, world, history)
            groups = pack_windows(windows, int(state["token_budget"]), bool(state["split_samples"]))
            tokens = sum(len(piece) for pieces in islice(groups, batches) for piece in pieces)
            # Packing emits the windows' tokens in stream order, so the windows started are those that begin
            # before the tokens emitted ran out.
            started, offset = 0, 0
            for window in self._window_stream(rank, world, history):
                if offset >= tokens:
                    break
                started, offset = started + 1, offset + len(window)
        return self.order.position_after(rank, world, history, started)


def validate_data_config(data_cfg: Any) -> dict:
    """The ``dataset`` config as a plain dict with defaults filled in; unknown keys and bad values are errors."""
    cfg = dict(data_cfg)
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown dataset config keys {unknown}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **cfg}
    if not cfg["path"]:
        raise ConfigError("dataset.path is required")
    if cfg["input_format"] not in ("thd", "bshd"):
        raise ConfigError(f"dataset.input_format must be thd or bshd, got {cfg['input_format']!r}")
    if cfg["max_seq_length"] < 2:
        raise ConfigError(f"dataset.max_seq_length must be at least 2, got {cfg['max_seq_length']}")
    if not 0 <= cfg["window_overlap"] < cfg["max_seq_length"]:
        raise ConfigError(
            f"dataset.window_overlap must be in [0, max_seq_length={cfg['max_seq_length']}), "
            f"got {cfg['window_overlap']}"
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
    """A ``StatefulDataLoader`` over this rank's batches: save ``state_dict()`` with a checkpoint to resume exactly.

    With ``cp_size > 1`` it yields full context-parallel batches (``context_parallel.context_parallel_batch``); every
    rank of a CP group reads the same ones (same ``dp_rank``), and the training loop keeps its own share with
    ``context_parallel.shard_for_context_parallel``.
    """
    cfg = validate_data_config(data_cfg)
    if cp_size > 1 and cfg["input_format"] != "thd":
        raise ConfigError(f"context parallelism (cp_size={cp_size}) needs dataset.input_format=thd")
    sequences = read_sequences(str(cfg["path"]), cfg["format"], cfg["sequence_column"], cfg["strip_whitespace"])
    tokens = tokenize(sequences, tokenizer)
    dataset = GenomicBatches(tokens, tokenizer, cfg, dp_rank, dp_world_size, seed, cp_size)
    logger.info(
        "Data: %d sequences, %d bases, %d windows of <= %d tokens",
        len(tokens),
        sum(len(t) - 2 for t in tokens),
        len(dataset.windows),
        cfg["max_seq_length"],
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


def held_out_batches(
    path: str, data_cfg: Any, tokenizer, dp_rank: int = 0, dp_world_size: int = 1, cp_size: int = 1
) -> HeldOutBatches:
    """This rank's validation batches of ``path`` for ``validation.Validator``, with the training windows and labels.

    The file is read and tokenized once, here, so a missing or unreadable ``validation.path`` stops the run before it
    trains (its format comes from its name: a held-out FASTA may sit beside Parquet training data). Rank r of n scores
    windows r, r + n, ... in file order. Windows are never split over two batches (a split window's tail would lose
    its context and the score of its first token), so every window is scored as the model sees it alone.
    """
    cfg = validate_data_config({**dict(data_cfg), "path": path, "format": "auto"})
    sequences = read_sequences(path, "auto", cfg["sequence_column"], cfg["strip_whitespace"], key="validation.path")
    tokens = tokenize(sequences, tokenizer)
    length, overlap = cfg["max_seq_length"], cfg["window_overlap"]
    windows = [seq[start : start + length] for seq in tokens for start in window_starts(len(seq), length, overlap)]
    mine = windows[dp_rank::dp_world_size]
    labels, pad = LabelMaker(tokenizer, cfg["uppercase_labels"], cfg["mask_degenerate_bases"]), pad_token_id(tokenizer)

    def collate(group: list[np.ndarray]) -> dict:
        if cfg["input_format"] == "bshd":
            return collate_bshd(group, labels, pad)
        batch = collate_thd(group, labels, length)
        return batch if cp_size == 1 else context_parallel_batch(batch, cp_size, pad)

    if cfg["input_format"] == "thd":
        groups = list(pack_windows(mine, max(cfg["token_budget"], length), split_samples=False))
    else:
        groups = [mine[i : i + cfg["micro_batch_size"]] for i in range(0, len(mine), cfg["micro_batch_size"])]
    # <bos><eos>, nothing scored: what a rank without validation windows runs so that collectives line up.
    placeholder = collate([np.array([tokenizer.bos_token_id, tokenizer.eos_token_id], dtype=np.int64)])
    for key in ("labels", "shift_labels"):
        if key in placeholder:
            placeholder[key].fill_(-100)
    return HeldOutBatches(
        read=lambda: (collate(group) for group in groups),
        placeholder=placeholder,
        causal_lm=True,
        description=f"{len(sequences)} sequence(s) of {path}, {len(windows)} windows of <= {length} tokens; "
        f"data-parallel rank {dp_rank} of {dp_world_size} scores {len(mine)} of them in {len(groups)} batch(es)",
    )
