"""Rank-value encoded cells for Geneformer masked-gene pre-training: read and validate Parquet files, truncate each
cell to its top-ranked genes, split per data-parallel rank, then mask and collate (collator.py: pad or pack).

A cell is a list of gene token ids, its expressed genes ranked by normalised expression, highest first (Geneformer's
rank-value encoding). The tokens are already ids: there is nothing to tokenize, and no <cls>/<eos> is added
(Geneformer V1 has none). The tokenizer only supplies the vocabulary size, <pad>, <mask> and the special ids.

``create_dataloader(data_cfg, tokenizer, dp_rank, dp_world_size, seed)`` is the entry point of the training
scripts. The loader it returns **yields forever**: it steps the epoch (re-seeding the shuffle) on its own, so a
training loop only calls ``next()``. Its ``state_dict()`` resumes exactly at the next batch.

``held_out_batches(path, data_cfg, tokenizer, dp_rank, dp_world_size, seed)`` builds the held-out cells that
``validation.Validator`` scores every ``validation.every_n_steps`` steps: read and validated once, with the same
rules, truncation and batching, and masked the same way at every evaluation.

Data config keys (``data_cfg``, any mapping or OmegaConf DictConfig; unknown keys are an error)::

    path: ???                  Parquet file, glob (``shards/*.parquet``) or directory of .parquet files (required);
                               a relative path is looked up from the working directory, then the recipe folder
    input_ids_column: input_ids    list<int> column: a cell's gene tokens, highest-ranked gene first
    max_seq_length: 2048       longer cells keep their first max_seq_length tokens (the top-ranked genes)
    empty_cell_policy: skip    skip (counted and logged) | error
    input_format: thd          bshd (padded [B, S]) | thd (packed [1, T])
    micro_batch_size: 8        BSHD: cells per micro-batch
    token_budget: 16384        THD: most tokens per packed micro-batch; must be >= max_seq_length
    pad_to_multiple_of: null   e.g. 16 for FP8 (BSHD: S, THD: T)
    mlm_probability: 0.15      fraction of genes to predict (80% <mask>, 10% a random gene, 10% unchanged)
    shuffle: true              reshuffle every epoch (DistributedSampler seeded with seed + epoch)
    num_workers: 1             dataloader worker processes

Validation happens once, when the loader is built, with vectorised checks over each file's flattened token column
(no per-cell Python loop). A broken file is a ``ConfigError`` (a ``ValueError``) naming the file, the row and the
column: a missing column (the message lists the columns there are), a column that is not a list of integers, a null
token, a token id outside the vocabulary (``0 <= id < len(tokenizer)``), a special token (<pad>, <mask>) inside a
cell, or a ``length`` column (optional; other columns are ignored) that disagrees with the list's length. Ids are
checked in the whole cell, including the genes truncation drops. Empty (or null) cells are skipped and counted, or an
error with ``empty_cell_policy: error``; no usable cell at all is an error. How many cells were read, truncated and
skipped is logged.

The tokens are held in memory as one flat array per file (uint16 when the vocabulary fits, else int32; truncated
tails dropped), shared copy-on-write with forked dataloader workers. Each data-parallel rank reads every file and
draws its own disjoint share of cells (``epoch_batch_sampler.py``: DistributedSampler, drop_last). Samples carry
``(epoch, sample_index)``, ``sample_index`` being the cell's row over all files, so masking (collator.py) is a pure
function of the seed and the sample. Random replacements are real genes only (the ids from the first non-special id
up to the vocabulary size), never <pad> or <mask>.
"""

import glob
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from collator import IGNORE_INDEX, BSHDCollator, MLMMasker, THDCollator
from epoch_batch_sampler import EpochBatchSampler, batches_in_order
from recipe_paths import RECIPE_DIR, recipe_path
from torchdata.stateful_dataloader import StatefulDataLoader
from user_errors import ConfigError, PathNotFoundError
from validation import HeldOutBatches


logger = logging.getLogger(__name__)

DEFAULT_DATA_CONFIG = {
    "path": None,
    "input_ids_column": "input_ids",
    "max_seq_length": 2048,
    "empty_cell_policy": "skip",
    "input_format": "thd",
    "micro_batch_size": 8,
    "token_budget": 16384,
    "pad_to_multiple_of": None,
    "mlm_probability": 0.15,
    "shuffle": True,
    "num_workers": 1,
}
EMPTY_CELL_POLICIES = ("skip", "error")
LENGTH_COLUMN = "length"

# ---------------------------------------------------------------------------------------------------- files


def parquet_files(path, key: str = "dataset.path") -> list[Path]:
    """The Parquet files ``path`` names: a file, a glob, or a directory (its ``*.parquet`` files), sorted. ``key`` is
    the config key that named it, for the error message."""
    path = str(path)
    if glob.has_magic(path):
        files = [Path(f) for f in sorted(glob.glob(path)) if os.path.isfile(f)]
        if not files and not os.path.isabs(path):  # a glob relative to the recipe folder
            files = [Path(f) for f in sorted(glob.glob(str(RECIPE_DIR / path))) if os.path.isfile(f)]
    else:
        resolved = recipe_path(path)
        files = sorted(resolved.glob("*.parquet")) if resolved.is_dir() else [resolved] if resolved.is_file() else []
    if not files:
        raise PathNotFoundError(
            f"data path {path!r} matches no Parquet file; point {key} at a .parquet file, a glob "
            "(shards/*.parquet) or a directory of .parquet files"
        )
    return files


# ------------------------------------------------------------------------------------------------- validation


@dataclass
class CellFile:
    """One file's cells after validation: a flat token array and, per cell, where it starts and how long it is
    (after truncation; 0 for an empty cell)."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    n_truncated: int


def _row_of(offsets: np.ndarray, flat_index: int) -> int:
    """The row (cell) whose tokens include position ``flat_index`` of the flattened column."""
    return int(np.searchsorted(offsets, flat_index, side="right") - 1)


def _list_column(file: Path, column: str) -> pa.LargeListArray:
    schema = pq.read_schema(file)
    if column not in schema.names:
        raise ConfigError(
            f"{file}: no column {column!r}; columns are {schema.names}: set dataset.input_ids_column to the one "
            "holding the cells' gene token ids"
        )
    kind = schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise ConfigError(
            f"{file}: column {column!r} is {kind}, not a list of integer gene token ids (one list per cell, "
            "highest-ranked gene first)"
        )
    # 64-bit offsets (a shard may hold more than 2**31 tokens); the ids keep the file's integer type.
    return pq.read_table(file, columns=[column]).column(column).cast(pa.large_list(kind.value_type)).combine_chunks()


def _check_length_column(file: Path, list_lengths: np.ndarray, column: str) -> None:
    if LENGTH_COLUMN not in pq.read_schema(file).names or column == LENGTH_COLUMN:
        return
    stated = pq.read_table(file, columns=[LENGTH_COLUMN]).column(LENGTH_COLUMN).combine_chunks()
    if not pa.types.is_integer(stated.type):
        raise ConfigError(f"{file}: column {LENGTH_COLUMN!r} is {stated.type}, not the cells' integer lengths")
    stated = stated.to_numpy(zero_copy_only=False)  # nulls become NaN (a float array): never equal
    wrong = np.flatnonzero(stated != list_lengths)
    if wrong.size:
        row = int(wrong[0])
        raise ConfigError(
            f"{file} row {row}: column {LENGTH_COLUMN!r} says {stated[row]} genes but column {column!r} holds "
            f"{list_lengths[row]} ({wrong.size} rows disagree); fix or drop the {LENGTH_COLUMN!r} column"
        )


def read_cell_file(
    file: Path, column: str, vocab_size: int, special_ids: dict[int, str], max_seq_length: int, empty_policy: str
) -> CellFile:
    """Read and validate one Parquet file of cells (see the module docstring for the rules)."""
    cells = _list_column(file, column)
    offsets = cells.offsets.to_numpy()  # int64, n_cells + 1
    values = cells.values.slice(offsets[0], offsets[-1] - offsets[0])
    offsets = offsets - offsets[0]
    list_lengths = np.diff(offsets)  # a null cell has an empty slot
    where = lambda flat: f"{file} row {_row_of(offsets, flat)}, column {column!r}"  # noqa: E731
    if values.null_count:
        first = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(f"{where(first)}: a null gene token; every token must be an id")
    tokens = values.to_numpy()
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        raise ConfigError(
            f"{where(int(bad[0]))}: gene token id {tokens[bad[0]]} is outside the vocabulary of {vocab_size} ids "
            f"(0..{vocab_size - 1}; {bad.size} such tokens in the file); the data must be encoded with the model's "
            "gene token dictionary"
        )
    special = np.flatnonzero(np.isin(tokens, np.fromiter(special_ids, dtype=np.int64)))
    if special.size:
        token = int(tokens[special[0]])
        raise ConfigError(
            f"{where(int(special[0]))}: token id {token} ({special_ids[token]}) is a special token; cells hold gene "
            f"tokens only ({special.size} special tokens in the file; masking and padding happen in the loader)"
        )
    _check_length_column(file, list_lengths, column)
    empty = np.flatnonzero(list_lengths == 0)
    if empty.size and empty_policy == "error":
        raise ConfigError(
            f"{file} row {int(empty[0])}, column {column!r}: an empty cell ({empty.size} in the file); set "
            "dataset.empty_cell_policy=skip to leave such cells out"
        )

    lengths = np.minimum(list_lengths, max_seq_length)
    n_truncated = int((list_lengths > max_seq_length).sum())
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    if n_truncated:  # keep only each cell's first max_seq_length tokens: the rest is never read
        position = np.arange(tokens.size) - np.repeat(offsets[:-1], list_lengths)
        tokens = tokens[position < max_seq_length]
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return CellFile(tokens.astype(dtype), starts, lengths, n_truncated)


class CellRows(torch.utils.data.Dataset):
    """Map-style view of the validated cells of all files, indexed by ``(epoch, row)`` pairs from
    ``EpochBatchSampler``; ``row`` counts cells over all files in order."""

    def __init__(self, files: list[CellFile]):
        self.tokens = [f.tokens for f in files]
        self.file_of_row = np.repeat(np.arange(len(files), dtype=np.int32), [len(f.lengths) for f in files])
        self.starts = np.concatenate([f.starts for f in files])
        self.lengths = np.concatenate([f.lengths for f in files])
        self.n_truncated = sum(f.n_truncated for f in files)

    def __len__(self):
        return len(self.lengths)

    def cell(self, row: int) -> np.ndarray:
        start = self.starts[row]
        return self.tokens[self.file_of_row[row]][start : start + self.lengths[row]].astype(np.int64)

    def __getitems__(self, keys):
        return [{"input_ids": self.cell(row), "epoch": epoch, "sample_index": row} for epoch, row in keys]

    def __getitem__(self, key):
        return self.__getitems__([key])[0]


def load_cells(
    path,
    tokenizer,
    column: str = "input_ids",
    max_seq_length: int = 2048,
    empty_cell_policy: str = "skip",
    key: str = "dataset.path",
) -> CellRows:
    """Read, validate and truncate every cell of ``path``; log how many were read, truncated and skipped. ``key`` is
    the config key that named ``path``, for error messages."""
    vocab_size = len(tokenizer)
    special_ids = dict(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens))
    files = parquet_files(path, key)
    cells = CellRows(
        [read_cell_file(f, column, vocab_size, special_ids, max_seq_length, empty_cell_policy) for f in files]
    )
    n_empty = int((cells.lengths == 0).sum())
    source = str(path) if len(files) > 1 else files[0].name
    summary = (
        f"{source}: read {len(cells)} cells from {len(files)} file(s); {cells.n_truncated} truncated to "
        f"max_seq_length {max_seq_length}; {n_empty} empty cells skipped"
    )
    (logger.warning if n_empty else logger.info)(summary)
    if n_empty == len(cells):
        raise ConfigError(f"{source}: no usable cell ({len(cells)} rows, all of them empty); check {key}")
    return cells


# ----------------------------------------------------------------------------------------------- entry point


def resolve_data_config(data_cfg) -> dict:
    cfg = dict(DEFAULT_DATA_CONFIG)
    unknown = sorted(set(data_cfg) - set(cfg))
    if unknown:
        raise ConfigError(f"unknown data config keys {unknown}; known keys: {sorted(cfg)}")
    cfg.update({key: data_cfg[key] for key in data_cfg})
    if not cfg["path"]:
        raise ConfigError("data config needs a path: set dataset.path to a Parquet file, glob or directory of cells")
    if cfg["input_format"] not in ("bshd", "thd"):
        raise ConfigError(f"input_format must be bshd or thd, got {cfg['input_format']!r}")
    if cfg["empty_cell_policy"] not in EMPTY_CELL_POLICIES:
        raise ConfigError(f"empty_cell_policy must be one of {EMPTY_CELL_POLICIES}, got {cfg['empty_cell_policy']!r}")
    for key in ("max_seq_length", "micro_batch_size", "token_budget"):
        if int(cfg[key]) < 1:
            raise ConfigError(f"{key} must be a positive number of tokens or cells, got {cfg[key]}")
    if cfg["input_format"] == "thd" and cfg["token_budget"] < cfg["max_seq_length"]:
        raise ConfigError(
            f"token_budget {cfg['token_budget']} < max_seq_length {cfg['max_seq_length']}: a long cell would not fit "
            "a packed micro-batch; raise dataset.token_budget or lower dataset.max_seq_length"
        )
    if not 0.0 <= float(cfg["mlm_probability"]) <= 1.0:
        raise ConfigError(f"mlm_probability must be in [0, 1], got {cfg['mlm_probability']}")
    return cfg


def gene_token_ids(tokenizer) -> tuple[int, int]:
    """The half-open id range random replacements draw from: from the first id that is not special (2 for
    Geneformer V1: after <pad> and <mask>) to the next special id or the vocabulary's end, so never <pad> or <mask>."""
    special, vocab_size = set(tokenizer.all_special_ids), len(tokenizer)
    first = next((i for i in range(vocab_size) if i not in special), None)
    if first is None:
        raise ConfigError("the tokenizer has no gene tokens: every id is a special token")
    return first, min((i for i in special if i > first), default=vocab_size)


def create_dataloader(data_cfg, tokenizer, dp_rank: int, dp_world_size: int, seed: int) -> StatefulDataLoader:
    """Build the endless, resumable training dataloader of one data-parallel rank (see the module docstring).

    ``tokenizer`` is a tokenizer or a path to one. ``seed`` must be the same on every rank (it orders and masks the
    data); pass the data-parallel rank and world size.
    """
    cfg = resolve_data_config(data_cfg)
    if isinstance(tokenizer, str | os.PathLike):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    cells = load_cells(
        cfg["path"], tokenizer, cfg["input_ids_column"], int(cfg["max_seq_length"]), cfg["empty_cell_policy"]
    )
    thd = cfg["input_format"] == "thd"
    batching = (
        {"token_budget": int(cfg["token_budget"])} if thd else {"micro_batch_size": int(cfg["micro_batch_size"])}
    )
    sampler = EpochBatchSampler(
        np.flatnonzero(cells.lengths > 0),
        cells.lengths,
        shuffle=bool(cfg["shuffle"]),
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        **batching,
    )
    masker = MLMMasker.from_tokenizer(
        tokenizer, seed=seed, mlm_probability=float(cfg["mlm_probability"]), random_token_ids=gene_token_ids(tokenizer)
    )
    collate = (THDCollator if thd else BSHDCollator)(masker, tokenizer.pad_token_id, cfg["pad_to_multiple_of"])
    with warnings.catch_warnings():
        # torchdata calls torch.set_vital, which torch 2.13 deprecates: a warning in every run that no user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            cells,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=int(cfg["num_workers"]),
            pin_memory=torch.cuda.is_available(),
        )


# ---------------------------------------------------------------------------------------------- held-out cells


def held_out_batches(
    path, data_cfg, tokenizer, dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0
) -> HeldOutBatches:
    """This rank's held-out batches of the cells in ``path`` (a Parquet file, glob or directory), for
    ``validation.Validator``, with the rules and batching of the ``dataset`` config ``data_cfg``.

    The cells are read and validated once, here (``load_cells``: the same checks, truncation to ``max_seq_length``
    and ``empty_cell_policy`` as the training data), so a missing or malformed file stops the run before it trains.
    Rank r of n scores the usable cells r, r + n, ... in file order, batched as training batches are (THD: as many
    cells as fit ``token_budget``; BSHD: ``micro_batch_size`` cells) by the training collator. Cell ``row`` is masked
    from ``(seed, epoch 0, row)``, so every evaluation scores the same masked genes.
    """
    cfg = resolve_data_config({**dict(data_cfg), "path": path})
    cells = load_cells(
        path,
        tokenizer,
        cfg["input_ids_column"],
        int(cfg["max_seq_length"]),
        cfg["empty_cell_policy"],
        key="validation.path",
    )
    usable = np.flatnonzero(cells.lengths > 0)
    thd = cfg["input_format"] == "thd"
    batching = (
        {"token_budget": int(cfg["token_budget"])} if thd else {"micro_batch_size": int(cfg["micro_batch_size"])}
    )
    groups = batches_in_order(usable[dp_rank::dp_world_size], cells.lengths, **batching)
    masker = MLMMasker.from_tokenizer(
        tokenizer, seed=seed, mlm_probability=float(cfg["mlm_probability"]), random_token_ids=gene_token_ids(tokenizer)
    )
    collate = (THDCollator if thd else BSHDCollator)(masker, tokenizer.pad_token_id, cfg["pad_to_multiple_of"])

    def read():
        for group in groups:
            yield collate(cells.__getitems__([(0, int(row)) for row in group]))

    # One gene, nothing scored (cells have no <cls>/<eos>): what a rank without held-out cells runs, so that every
    # rank runs the same number of forward passes.
    one_gene = np.array([gene_token_ids(tokenizer)[0]], dtype=np.int64)
    placeholder = collate([{"input_ids": one_gene, "epoch": 0, "sample_index": 0}])
    placeholder["labels"].fill_(IGNORE_INDEX)
    return HeldOutBatches(
        read=read,
        placeholder=placeholder,
        causal_lm=False,
        description=f"{len(usable)} usable cells of {path}; data-parallel rank {dp_rank} of {dp_world_size} scores "
        f"{sum(len(g) for g in groups)} of them in {len(groups)} batch(es), masked from seed {seed}",
    )
