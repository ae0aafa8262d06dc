"""Protein sequences for ESM-2 and AMPLIFY masked-LM pre-training: read, validate, tokenize, split per data-parallel
rank, then mask and collate (collator.py: pad or pack, padded for context parallelism).

``create_dataloader(data_cfg, tokenizer, dp_rank, dp_world_size, seed, cp_size=1)`` is the entry point of the
training scripts. The loader it returns **yields forever**: it steps the epoch (re-seeding the shuffle) on its
own, so a training loop only calls ``next()``. Its ``state_dict()`` resumes exactly at the next batch.

Data config keys (``data_cfg``, any mapping or OmegaConf DictConfig; unknown keys are an error)::

    path: ???                  file, glob (``shards/*.parquet``), directory or HF dataset name (required)
    format: auto               auto | parquet | csv | jsonl | fasta | hf. auto: from the suffix (.parquet, .csv,
                               .jsonl/.json, .fasta/.fa/.faa/.fas, each optionally .gz); anything else is hf
    name: null                 HF dataset configuration name (format hf)
    split: train               HF split (a file source is always one split)
    streaming: false           stream instead of tokenizing everything up front with datasets.map
    sequence_column: sequence  column holding the residues (FASTA sources always provide "id" and "sequence")
    max_seq_length: 1024       tokens per sequence including the start and end tokens (<cls>/<bos>, <eos>)
    invalid_residue_policy: error     error | skip | replace_unk
    long_sequence_policy: truncate    truncate | skip | error
    input_format: bshd         bshd (padded [B, S]) | thd (packed [1, T])
    micro_batch_size: 8        sequences per BSHD batch
    token_budget: 8192         THD: most tokens per packed batch (CP padding included); must be >= max_seq_length
    pad_to_multiple_of: null   e.g. 16 for FP8 (BSHD: S, THD: T; per CP shard when cp_size > 1)
    mlm_probability: 0.15
    shuffle: true              reshuffle every epoch (map-style: DistributedSampler seeded with seed + epoch)
    shuffle_buffer_size: 0     streaming shuffle buffer; > 0 shuffles, but a resume then refills the buffer
                               (not exact), so the default keeps resumes exact
    num_workers: 1             dataloader worker processes
    num_proc: null             processes for datasets.map tokenization (map-style)
    cache_dir: null            datasets cache directory (null: the HF default)

Validation (one policy for map-style and streaming; counts are logged, never silently dropped):

- Whitespace inside a sequence is removed and lowercase is uppercased. Empty sequences (or nulls) are skipped.
- The residue alphabet is the tokenizer's single-character tokens (LAGVSERTIDPKQNFYMHWCXBUZO.-). Another
  character is an ``error`` (ValueError naming source, row and characters), ``skip`` drops the sequence, or
  ``replace_unk`` encodes each such character as one <unk>.
- A sequence longer than ``max_seq_length - 2`` residues is ``truncate``d to a random window seeded by
  ``(seed, row)`` (streaming: ``(seed, epoch, sample_index)``), ``skip``ped, or an ``error``.

Each data-parallel rank reads different data: pass the DP rank and DP world size, not the global rank, because the
CP ranks of one DP group must see the same batches. ``seed`` must be the same on every rank. Map-style data is
ordered by a ``DistributedSampler`` (drop_last, so DP ranks are disjoint); streaming data is split with
``datasets.distributed.split_dataset_by_node``. Samples carry ``(epoch, sample_index)`` so masking (collator.py)
is a pure function of the seed and the sample.
"""

import contextlib
import copy
import glob
import gzip
import logging
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
from collator import BSHDCollator, MLMMasker, THDCollator, round_up
from datasets.distributed import split_dataset_by_node
from epoch_batch_sampler import EpochBatchSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from user_errors import ConfigError, PathNotFoundError


logger = logging.getLogger(__name__)

DEFAULT_DATA_CONFIG = {
    "path": None,
    "format": "auto",
    "name": None,
    "split": "train",
    "streaming": False,
    "sequence_column": "sequence",
    "max_seq_length": 1024,
    "invalid_residue_policy": "error",
    "long_sequence_policy": "truncate",
    "input_format": "bshd",
    "micro_batch_size": 8,
    "token_budget": 8192,
    "pad_to_multiple_of": None,
    "mlm_probability": 0.15,
    "shuffle": True,
    "shuffle_buffer_size": 0,
    "num_workers": 1,
    "num_proc": None,
    "cache_dir": None,
}
SUFFIX_FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}
SUFFIX_FORMATS.update(dict.fromkeys((".fasta", ".fa", ".faa", ".fas"), "fasta"))
BUILDERS = {"parquet": "parquet", "csv": "csv", "jsonl": "json"}

# ---------------------------------------------------------------------------------------------------- sources


def detect_format(path: str) -> str:
    name = str(path).lower().removesuffix(".gz")
    return SUFFIX_FORMATS.get(os.path.splitext(name)[1], "hf")


def _expand_files(path: str, key: str = "dataset.path") -> list[str]:
    files = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise PathNotFoundError(
            f"data path {path!r} matches no file" + (f" ({missing[0]!r} missing)" if missing else "") + f"; point "
            f"{key} at a FASTA, Parquet, CSV or JSONL file, a glob, or a Hugging Face dataset"
        )
    return files


def read_fasta(paths: list[str]):
    """Yield ``{"id", "sequence"}`` records. Headers start with '>', sequences may span lines, blank lines are
    ignored; residues before the first header make the file malformed (ValueError naming file and line)."""
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        header, lines, n_records = None, [], 0
        with opener(path, "rt") as handle:
            for line_no, line in enumerate(handle, start=1):
                line = line.strip()
                if not line:
                    continue
                if line.startswith(">"):
                    if header is not None:
                        yield {"id": header, "sequence": "".join(lines)}
                        n_records += 1
                    header, lines = (line[1:].split() or [""])[0], []
                elif header is None:
                    raise ConfigError(f"malformed FASTA {path}: line {line_no} has residues before any '>' header")
                else:
                    lines.append(line)
        if header is not None:
            yield {"id": header, "sequence": "".join(lines)}
            n_records += 1
        if n_records == 0:
            raise ConfigError(
                f"malformed FASTA {path}: no '>' header found (is the file empty?); point dataset.path at FASTA records"
            )


def _fasta_dataset(files: list[str], streaming: bool, cache_dir):
    if streaming:
        return datasets.IterableDataset.from_generator(read_fasta, gen_kwargs={"paths": files})
    # Size and mtime belong to the cache fingerprint so an edited file is re-read, not served stale.
    stamp = [(os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    try:
        return datasets.Dataset.from_generator(
            _read_fasta_stamped, gen_kwargs={"paths": files, "stamp": stamp}, cache_dir=cache_dir
        )
    except Exception as err:  # datasets wraps generator errors; surface the parser's own message
        cause = err
        while cause is not None and not (isinstance(cause, ValueError) and "FASTA" in str(cause)):
            cause = cause.__cause__ or cause.__context__
        raise (cause or err) from None


def _read_fasta_stamped(paths, stamp):
    yield from read_fasta(paths)


def load_sequences(
    path: str,
    format: str = "auto",
    sequence_column: str = "sequence",
    split: str = "train",
    name: str | None = None,
    streaming: bool = False,
    cache_dir: str | None = None,
    key: str = "dataset.path",
    column_key: str = "dataset.sequence_column",
):
    """Open a sequence source as a ``datasets.Dataset`` (or ``IterableDataset`` when streaming); ``key`` and
    ``column_key`` are the config keys that named it and its sequence column, for error messages."""
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "fasta":
        ds = _fasta_dataset(_expand_files(path, key), streaming, cache_dir)
    elif fmt in BUILDERS:
        ds = datasets.load_dataset(
            BUILDERS[fmt], data_files=_expand_files(path, key), split="train", streaming=streaming, cache_dir=cache_dir
        )
    elif fmt == "hf":
        ds = datasets.load_dataset(path, name, split=split, streaming=streaming, cache_dir=cache_dir)
    else:
        raise ConfigError(f"unknown data format {format!r}: use auto, {', '.join([*BUILDERS, 'fasta', 'hf'])}")
    columns = ds.column_names
    if columns is None:  # a stream whose features are unknown until read
        columns = list(next(iter(ds)).keys())
    if sequence_column not in columns:
        raise ConfigError(
            f"{path}: no column {sequence_column!r}; columns are {columns}: set {column_key} to one of them"
        )
    return ds


# ------------------------------------------------------------------------------------------------- validation


INVALID_POLICIES = ("error", "skip", "replace_unk")
LONG_POLICIES = ("truncate", "skip", "error")
KEPT, SKIP_EMPTY, SKIP_INVALID, SKIP_LONG = 0, 1, 2, 3
SKIP_NAMES = {SKIP_EMPTY: "empty", SKIP_INVALID: "invalid residues", SKIP_LONG: "too long"}


def residue_token_ids(tokenizer) -> tuple[int, int]:
    """The half-open id range of the tokenizer's residues (its one-letter upper-case tokens), which masking draws its
    random replacements from: ESM-2's L..O are ids 4..28, AMPLIFY's L..B ids 6..26. Never a special token, '.', '-',
    '|' or an id past the vocabulary."""
    ids = sorted(
        i for token, i in tokenizer.get_vocab().items() if len(token) == 1 and token.isalpha() and token.isupper()
    )
    if not ids or ids != list(range(ids[0], ids[-1] + 1)):
        raise ConfigError(
            f"the tokenizer's one-letter residues are not one run of ids ({ids}); a protein tokenizer lists them "
            "together (ESM-2: 4..28, AMPLIFY: 6..26)"
        )
    return ids[0], ids[-1] + 1


@dataclass(frozen=True)
class SequencePolicy:
    alphabet: str
    max_seq_length: int
    invalid_residue_policy: str = "error"
    long_sequence_policy: str = "truncate"

    def __post_init__(self):
        if self.invalid_residue_policy not in INVALID_POLICIES:
            raise ConfigError(f"invalid_residue_policy must be one of {INVALID_POLICIES}")
        if self.long_sequence_policy not in LONG_POLICIES:
            raise ConfigError(f"long_sequence_policy must be one of {LONG_POLICIES}")
        if self.max_seq_length < 3:
            raise ConfigError(
                f"max_seq_length {self.max_seq_length} leaves no room for residues besides the start and end tokens"
            )

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> "SequencePolicy":
        alphabet = "".join(sorted(t for t in tokenizer.get_vocab() if len(t) == 1 and not t.islower()))
        return cls(alphabet, **kwargs)

    def clean(self, raw, crop_seed, where: str) -> tuple[str, int, int, bool]:
        """Return ``(text_for_tokenizer, skip_code, n_replaced, truncated)``; text is "" when skipped."""
        seq = "".join(str(raw).split()).upper() if raw is not None else ""
        if not seq:
            return "", SKIP_EMPTY, 0, False
        bad = set(seq).difference(self.alphabet)
        if bad and self.invalid_residue_policy == "error":
            raise ConfigError(
                f"{where}: characters {sorted(bad)} are not residues of the tokenizer; set invalid_residue_policy "
                "to skip or replace_unk to accept such data"
            )
        if bad and self.invalid_residue_policy == "skip":
            return "", SKIP_INVALID, 0, False
        max_residues = self.max_seq_length - 2
        truncated = len(seq) > max_residues
        if truncated and self.long_sequence_policy == "error":
            raise ConfigError(
                f"{where}: {len(seq)} residues > max_seq_length - 2 = {max_residues}; raise dataset.max_seq_length "
                "or set dataset.long_sequence_policy to truncate or skip"
            )
        if truncated and self.long_sequence_policy == "skip":
            return "", SKIP_LONG, 0, False
        if truncated:
            start = int(np.random.default_rng(list(crop_seed)).integers(len(seq) - max_residues + 1))
            seq = seq[start : start + max_residues]
        n_replaced = 0
        if bad:
            # The tokenizer folds a *run* of unknown characters into one <unk>; one <unk> per character keeps the
            # token count equal to the residue count.
            seq, n_replaced = re.subn(f"[^{re.escape(self.alphabet)}]", "<unk>", seq)
        return seq, KEPT, n_replaced, truncated


class DataStats(Counter):
    """Counts of what validation did: kept, skipped per reason, sequences truncated / with replaced residues."""

    def add(self, skip_code: int, n_replaced: int, truncated: bool) -> None:
        self["seen"] += 1
        self["kept" if skip_code == KEPT else f"skipped ({SKIP_NAMES[skip_code]})"] += 1
        self["truncated"] += int(truncated)
        self["with replaced residues"] += int(n_replaced > 0)
        self["residues replaced by <unk>"] += n_replaced

    def log(self, source: str) -> None:
        changed = {k: v for k, v in self.items() if v and k not in ("seen", "kept")}
        summary = f"{source}: kept {self['kept']} of {self['seen']} sequences"
        if changed:
            logger.warning("%s; %s", summary, ", ".join(f"{k}: {v}" for k, v in sorted(changed.items())))
        else:
            logger.info(summary)


# ---------------------------------------------------------------------------------------- map-style data


def _tokenize_batch(batch, indices, *, column, policy, tokenizer, seed, source):
    cleaned = [policy.clean(raw, (seed, row), f"{source} row {row}") for raw, row in zip(batch[column], indices)]
    kept = [text for text, code, _, _ in cleaned if code == KEPT]
    encoded = iter(tokenizer(kept, add_special_tokens=True)["input_ids"]) if kept else iter(())
    input_ids = [next(encoded) if code == KEPT else [] for _, code, _, _ in cleaned]
    return {
        "input_ids": input_ids,
        "length": [len(ids) for ids in input_ids],
        "skip": [code for _, code, _, _ in cleaned],
        "n_replaced": [n for _, _, n, _ in cleaned],
        "truncated": [t for _, _, _, t in cleaned],
    }


def tokenize_dataset(
    ds: datasets.Dataset,
    tokenizer,
    policy: SequencePolicy,
    seed: int,
    column="sequence",
    source="dataset",
    num_proc=None,
) -> tuple[datasets.Dataset, DataStats]:
    """Validate and tokenize every row with a cacheable batched ``datasets.map``; return ``(dataset, stats)``.

    Skipped rows stay in the table (with empty ``input_ids``) so row numbers remain sample identities; the sampler
    only draws rows whose ``skip`` code is 0.
    """
    fn = partial(_tokenize_batch, column=column, policy=policy, tokenizer=tokenizer, seed=seed, source=source)
    ds = ds.map(
        fn, batched=True, with_indices=True, remove_columns=ds.column_names, num_proc=num_proc, desc="Tokenizing"
    )
    skip, n_replaced, truncated = (ds.data.column(k).to_numpy() for k in ("skip", "n_replaced", "truncated"))
    stats = DataStats({"seen": len(skip), "kept": int((skip == KEPT).sum())})
    for code, reason in SKIP_NAMES.items():
        stats[f"skipped ({reason})"] = int((skip == code).sum())
    stats["truncated"] = int(truncated.sum())
    stats["with replaced residues"] = int((n_replaced > 0).sum())
    stats["residues replaced by <unk>"] = int(n_replaced.sum())
    return ds, stats


class TokenizedRows(torch.utils.data.Dataset):
    """Map-style view of a tokenized table, indexed by ``(epoch, row)`` pairs from ``EpochBatchSampler``."""

    def __init__(self, ds: datasets.Dataset):
        self.ds = ds.select_columns(["input_ids"])

    def __len__(self):
        return len(self.ds)

    def __getitems__(self, keys):
        rows = self.ds[[row for _, row in keys]]["input_ids"]
        return [
            {"input_ids": np.asarray(ids, dtype=np.int64), "epoch": epoch, "sample_index": row}
            for (epoch, row), ids in zip(keys, rows)
        ]

    def __getitem__(self, key):
        return self.__getitems__([key])[0]


# ------------------------------------------------------------------------------------------------ streaming


class StreamingSamples(torch.utils.data.IterableDataset):
    """Endless, resumable stream of sample lists (one list = one batch) from a streaming HF dataset.

    Validation and tokenization happen on the fly. ``sample_index`` is a running count of the examples this rank
    and worker have read, interleaved over workers and DP ranks so it is unique. The state (epoch, count, the HF
    dataset's own position, and a sample read but not yet batched) lets StatefulDataLoader resume exactly, unless
    a shuffle buffer is used.
    """

    def __init__(self, hf_ds, tokenizer, policy, column, segment_multiple=1, source="stream", *, dp_rank,
                 dp_world_size, seed, micro_batch_size=None, token_budget=None):  # fmt: skip
        self.hf_ds, self.tokenizer, self.policy, self.column, self.source = hf_ds, tokenizer, policy, column, source
        self.dp_rank, self.dp_world_size, self.seed = dp_rank, dp_world_size, seed
        self.micro_batch_size, self.token_budget = micro_batch_size, token_budget
        self.segment_multiple = segment_multiple
        self._state = {"epoch": 0, "count": 0, "hf": None, "pending": []}

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._state = copy.deepcopy(state)

    def _samples(self, worker_id: int, n_workers: int, stats: DataStats):
        """Yield (sample, hf_state_after_it) for the current epoch."""
        state = self._state
        self.hf_ds.set_epoch(state["epoch"])
        if state["hf"] is not None and state["hf"]["epoch"] == state["epoch"]:
            self.hf_ds.load_state_dict(state["hf"])
        for example in self.hf_ds:
            index = (state["count"] * n_workers + worker_id) * self.dp_world_size + self.dp_rank
            state["count"] += 1
            text, code, n_replaced, truncated = self.policy.clean(
                example[self.column], (self.seed, state["epoch"], index), f"{self.source} sample {index}"
            )
            stats.add(code, n_replaced, truncated)
            if code == KEPT:
                # Plain lists, so that a pending sample in the state is a plain-python checkpoint entry.
                ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
                yield {"input_ids": ids, "epoch": state["epoch"], "sample_index": index}

    def _fits(self, batch, sample) -> bool:
        if self.token_budget is None:
            return len(batch) < self.micro_batch_size
        tokens = sum(round_up(len(s["input_ids"]), self.segment_multiple) for s in [*batch, sample])
        return tokens <= self.token_budget

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker_id, n_workers = (info.id, info.num_workers) if info else (0, 1)
        state = self._state
        while True:
            stats = DataStats()
            batch, state["pending"] = state["pending"], []
            for sample in self._samples(worker_id, n_workers, stats):
                if self._fits(batch, sample):
                    batch.append(sample)
                    continue
                # A batch is emitted when the next sample does not fit; that sample is part of the state.
                state["hf"], state["pending"] = self.hf_ds.state_dict(), [sample]
                yield batch
                batch, state["pending"] = [sample], []
            stats.log(f"{self.source} (DP rank {self.dp_rank}, worker {worker_id}, epoch {state['epoch']})")
            if stats["seen"] and not stats["kept"] and not batch:
                raise ConfigError(
                    f"{self.source}: no usable sequence in a whole epoch of this rank's shard; check the data and "
                    "dataset.invalid_residue_policy / long_sequence_policy"
                )
            state["epoch"], state["hf"] = state["epoch"] + 1, None
            if batch:  # the epoch's last, partial batch
                yield batch
            elif not stats["seen"]:
                return  # this worker got no shard of the stream (more workers than shards)


# ----------------------------------------------------------------------------------------------- entry point


def resolve_data_config(data_cfg) -> dict:
    cfg = dict(DEFAULT_DATA_CONFIG)
    unknown = sorted(set(data_cfg) - set(cfg))
    if unknown:
        raise ConfigError(f"unknown data config keys {unknown}; known keys: {sorted(cfg)}")
    cfg.update({key: data_cfg[key] for key in data_cfg})
    if not cfg["path"]:
        raise ConfigError("data config needs a path")
    if cfg["input_format"] not in ("bshd", "thd"):
        raise ConfigError(f"input_format must be bshd or thd, got {cfg['input_format']!r}")
    return cfg


@contextlib.contextmanager
def local_rank_zero_first():
    """Let local rank 0 build the datasets cache (Arrow files, tokenized map) while the other ranks wait, so they
    read it instead of racing to write it. Every rank passes exactly one barrier."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if distributed and not first:
        torch.distributed.barrier()
    yield
    if distributed and first:
        torch.distributed.barrier()


def create_dataloader(
    data_cfg, tokenizer, dp_rank: int, dp_world_size: int, seed: int, cp_size: int = 1
) -> StatefulDataLoader:
    """Build the endless, resumable training dataloader of one data-parallel rank (see the module docstring).

    ``tokenizer`` is a tokenizer or a path to one. With ``cp_size > 1`` every sequence is padded for context
    parallelism and the loader yields the full batch; all CP ranks of a data-parallel group read the same batches and
    the training loop keeps each rank's share (``context_parallel.shard_for_context_parallel``). Under
    ``torch.distributed`` every rank must call this (one barrier guards the datasets cache).
    """
    cfg = resolve_data_config(data_cfg)
    if isinstance(tokenizer, str | os.PathLike):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    thd = cfg["input_format"] == "thd"
    segment_multiple = 2 * cp_size if cp_size > 1 else 1
    if thd and round_up(cfg["max_seq_length"], segment_multiple) > cfg["token_budget"]:
        raise ConfigError(f"token_budget {cfg['token_budget']} < max_seq_length {cfg['max_seq_length']} (CP-padded)")
    batching = {"token_budget": cfg["token_budget"]} if thd else {"micro_batch_size": cfg["micro_batch_size"]}
    batching.update(dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed)

    policy_keys = ("max_seq_length", "invalid_residue_policy", "long_sequence_policy")
    policy = SequencePolicy.from_tokenizer(tokenizer, **{key: cfg[key] for key in policy_keys})
    masker = MLMMasker.from_tokenizer(
        tokenizer, seed=seed, mlm_probability=cfg["mlm_probability"], random_token_ids=residue_token_ids(tokenizer)
    )
    collator_cls = THDCollator if thd else BSHDCollator
    collate = collator_cls(masker, tokenizer.pad_token_id, cfg["pad_to_multiple_of"], cp_size)

    source_keys = ("format", "sequence_column", "split", "name", "streaming", "cache_dir")
    source, column = Path(cfg["path"]).name, cfg["sequence_column"]
    if cfg["streaming"]:
        ds = load_sequences(str(cfg["path"]), **{key: cfg[key] for key in source_keys})
        ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_world_size)
        if cfg["shuffle"] and cfg["shuffle_buffer_size"] > 0:
            ds = ds.shuffle(seed=seed, buffer_size=cfg["shuffle_buffer_size"])
        dataset = StreamingSamples(ds, tokenizer, policy, column, segment_multiple, source, **batching)
        loader_kw = {"batch_size": None}
    else:
        with local_rank_zero_first():
            ds = load_sequences(str(cfg["path"]), **{key: cfg[key] for key in source_keys})
            ds, stats = tokenize_dataset(ds, tokenizer, policy, seed, column, source, cfg["num_proc"])
        stats.log(source)
        usable = np.flatnonzero(ds.data.column("skip").to_numpy() == KEPT)
        lengths = round_up(ds.data.column("length").to_numpy(), segment_multiple)
        sampler = EpochBatchSampler(usable, lengths, shuffle=cfg["shuffle"], **batching)
        dataset, loader_kw = TokenizedRows(ds), {"batch_sampler": sampler}
    with warnings.catch_warnings():
        # torchdata calls torch.set_vital, which torch 2.13 deprecates: a warning in every run that no user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            dataset,
            collate_fn=collate,
            num_workers=cfg["num_workers"],
            pin_memory=torch.cuda.is_available(),
            **loader_kw,
        )
