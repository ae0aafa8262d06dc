"""``CodonDataModule``: the Lightning data module of the recipe, for masked-codon pre-training (``task: mlm``),
sequence-level fine-tuning (``regression`` / ``classification``) and prediction.

It is built from the ``data`` section of the config (a dict or DictConfig; unknown keys are an error)::

    train_path: null            FASTA / Parquet / CSV / TSV file, or a directory of them (dataset.py); needed to fit
    val_path: null              separate validation file(s); null: hold out val_fraction of train_path
    val_fraction: 0.05          fraction of train_path held out for validation when val_path is null (seeded; 0: none)
    predict_path: null          file(s) predict_dataloader reads (predict.py)
    sequence_column: sequence   table column with the coding sequences (FASTA needs none)
    label_column: label         table column with the label (fine-tuning only)
    task: mlm                   mlm | regression (a float per sequence) | classification (a class 0..C-1)
    num_classes: null           classification: null counts max(label) + 1 over train and val
    invalid_codon_policy: error error | skip | unk (sequences.py): what happens to a sequence that is not whole codons
    max_codons: 2046            longer sequences keep their first max_codons codons (+ <CLS>, <SEP> = 2048 tokens)
    input_format: thd           mlm: thd (packed [1, T] with cu_seq_lens) | bshd (padded [B, S]); fine-tuning: bshd
    micro_batch_size: 8         sequences per BSHD micro-batch (fine-tuning and prediction are BSHD)
    token_budget: 8192          tokens per THD micro-batch (greedy packing); must be >= max_codons + 2
    pad_to_multiple_of: null    e.g. 16 for FP8 (BSHD: S, THD: T)
    mlm_probability: 0.15       codons to predict (80% <MASK>, 10% a random codon, 10% unchanged)
    seed: 42                    orders the data, splits off validation, draws the masks; the same on every rank
    num_workers: 1              dataloader worker processes
    pin_memory: true            pin host memory (only when CUDA is available)

Data parallelism: every rank reads the files and takes its own disjoint share (rank = ``trainer.global_rank``, world
= ``trainer.world_size``; all of them are data-parallel ranks under DDP and FSDP). The Trainer must leave sampling to
this module: ``Trainer(use_distributed_sampler=False)`` (checked in ``setup`` when there is more than one rank).

Batches (collator.py for masked LM; its docstring has the full contract):

- mlm, thd:  ``input_ids``/``labels`` [1, T] int64 (labels -100 where no loss), ``cu_seq_lens_q``/``cu_seq_lens_k``
  int32 [n + 1], ``max_length_q``/``max_length_k`` ints;
- mlm, bshd: ``input_ids``/``attention_mask``/``labels`` [B, S] int64;
- fine-tuning: ``input_ids``/``attention_mask`` [B, S] int64 and ``labels`` [B] (float32 for regression, int64
  for classification);
- prediction: ``input_ids``/``attention_mask`` [B, S] int64, ``sample_index`` [B] int64 (row in predict_path) and
  ``names`` (list of the sequences' ids). Nothing is masked.

Resuming: the training loader is a torchdata ``StatefulDataLoader`` whose batch sampler (``epoch_batch_sampler.py``)
walks the data epoch after epoch on its own, reshuffled each epoch, and never ends: stop training with the Trainer's
``max_steps`` and validate every ``val_check_interval`` steps (an int: a fraction of an endless epoch never comes). Lightning 2.6 stores every stateful training
loader's ``state_dict()`` in its checkpoints (``FitLoop.on_save_checkpoint``, key ``loops.fit_loop.state_dict.
combined_loader``) and, on ``trainer.fit(..., ckpt_path=...)``, hands it back to the fresh loader before it makes
the iterator (``FitLoop.setup_data`` → ``_load_combined_loader_states``), so training continues with the batch
that followed the checkpoint. This needs the loader to have a length: for a loader without one Lightning's
``_PrefetchDataFetcher`` fetches one batch ahead, the saved position is one batch later than the step, and a resumed
run would skip a batch. So the training loader reports ``ENDLESS`` batches (one Lightning epoch never ends); the
data epochs are its own, in each sample's ``epoch``. tests/test_datamodule.py resumes a run this way and compares
every batch with an uninterrupted run (without the length that test fails). Validation batches are fixed (masks drawn with epoch 0), the
same number on every rank so that FSDP's collective calls stay matched.
"""

import logging
import math
import warnings

import lightning
import numpy as np
import torch
from collator import BSHDCollator, MLMMasker, THDCollator, round_up
from dataset import TASKS, CodonSamples, CodonSequences, read_sequences, split_rows
from epoch_batch_sampler import EpochBatchSampler
from sequences import FIRST_CODON_ID, MASK_ID, PAD_ID, POLICIES, VOCAB_SIZE
from torchdata.stateful_dataloader import StatefulDataLoader
from user_errors import ConfigError


logger = logging.getLogger(__name__)

DEFAULT_DATA_CONFIG = {
    "train_path": None,
    "val_path": None,
    "val_fraction": 0.05,
    "predict_path": None,
    "sequence_column": "sequence",
    "label_column": "label",
    "task": "mlm",
    "num_classes": None,
    "invalid_codon_policy": "error",
    "max_codons": 2046,
    "input_format": "thd",
    "micro_batch_size": 8,
    "token_budget": 8192,
    "pad_to_multiple_of": None,
    "mlm_probability": 0.15,
    "seed": 42,
    "num_workers": 1,
    "pin_memory": True,
}
# Lightning sums the loader length over ranks in an int64 tensor (has_len_all_ranks): stay far below 2**63.
ENDLESS = 2**40


def resolve_data_config(data_cfg) -> dict:
    """The ``data`` section with defaults filled in, checked (one-line ``ConfigError`` for a bad value)."""
    data_cfg = dict(data_cfg or {})
    unknown = sorted(set(data_cfg) - set(DEFAULT_DATA_CONFIG))
    if unknown:
        raise ConfigError(f"unknown data config keys {unknown}; known keys: {sorted(DEFAULT_DATA_CONFIG)}")
    cfg = {**DEFAULT_DATA_CONFIG, **data_cfg}
    if cfg["task"] not in TASKS:
        raise ConfigError(f"data.task must be one of {TASKS}, got {cfg['task']!r}")
    if cfg["invalid_codon_policy"] not in POLICIES:
        raise ConfigError(f"data.invalid_codon_policy must be one of {POLICIES}, got {cfg['invalid_codon_policy']!r}")
    if cfg["input_format"] not in ("thd", "bshd"):
        raise ConfigError(f"data.input_format must be thd or bshd, got {cfg['input_format']!r}")
    if cfg["task"] != "mlm" and cfg["input_format"] != "bshd":
        raise ConfigError(
            f"data.task={cfg['task']} reads padded batches (one label per sequence): set data.input_format=bshd"
        )
    if cfg["task"] != "mlm" and not cfg["label_column"]:
        raise ConfigError(f"data.task={cfg['task']} needs data.label_column, the column that holds the labels")
    for key, minimum in (("max_codons", 1), ("micro_batch_size", 1), ("token_budget", 1), ("seed", 0),
                         ("num_workers", 0)):  # fmt: skip
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "positive" if minimum else "non-negative"
            raise ConfigError(f"data.{key} must be a {kind} integer, got {value!r}")
    if cfg["input_format"] == "thd" and cfg["token_budget"] < cfg["max_codons"] + 2:
        raise ConfigError(
            f"data.token_budget={cfg['token_budget']} < max_codons + 2 = {cfg['max_codons'] + 2}: the longest "
            "sequence would not fit a packed micro-batch; raise data.token_budget or lower data.max_codons"
        )
    for key, top in (("mlm_probability", "1]"), ("val_fraction", "1)")):
        value = cfg[key]
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else -1.0
        if not 0.0 <= number <= 1.0 or (top == "1)" and number == 1.0):
            raise ConfigError(f"data.{key} must be a number in [0, {top}, got {value!r}")
    multiple = cfg["pad_to_multiple_of"]
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        raise ConfigError(f"data.pad_to_multiple_of must be a positive integer or null, got {multiple!r}")
    if cfg["num_classes"] is not None and (not isinstance(cfg["num_classes"], int) or cfg["num_classes"] < 2):
        raise ConfigError(f"data.num_classes must be an integer >= 2 or null, got {cfg['num_classes']!r}")
    return cfg


# ------------------------------------------------------------------------------------------------ batch orders


class TrainBatchSampler(EpochBatchSampler):
    """``EpochBatchSampler`` (endless, resumable) with a length, so that Lightning does not fetch ahead (see the
    module docstring); the length is ``ENDLESS``, never reached."""

    def __len__(self) -> int:
        return ENDLESS


def greedy_batches(rows: np.ndarray, lengths: np.ndarray, micro_batch_size=None, token_budget=None) -> list[list]:
    """Cut ``rows`` in order into batches of ``micro_batch_size`` rows, or of as many rows as fit ``token_budget``."""
    if token_budget is None:
        return [list(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    batches, current, total = [], [], 0
    for row in rows:
        if current and total + lengths[row] > token_budget:
            batches.append(current)
            current, total = [], 0
        current.append(row)
        total += lengths[row]
    return batches + ([current] if current else [])


def equal_count_batches(rows_per_rank: list, lengths, micro_batch_size=None, token_budget=None) -> list[list]:
    """Each rank's batches, every rank with the same number: a rank with fewer splits its largest batches in two.

    FSDP gathers parameters in every forward, so ranks running different numbers of validation steps would hang.
    Each rank holds the same number of rows, so the split always succeeds (a batch needs one row).
    """
    per_rank = [greedy_batches(rows, lengths, micro_batch_size, token_budget) for rows in rows_per_rank]
    target = max(len(batches) for batches in per_rank)
    for batches in per_rank:
        while len(batches) < target:
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            batch = batches[largest]
            batches[largest : largest + 1] = [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return per_rank


# --------------------------------------------------------------------------------------------------- collators


def _padded(samples, pad_to_multiple_of) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = round_up(max(len(s["input_ids"]) for s in samples), pad_to_multiple_of or 1)
    input_ids = torch.full((len(samples), seq_len), PAD_ID, dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), seq_len), dtype=torch.int64)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample["input_ids"])] = torch.as_tensor(sample["input_ids"])
        attention_mask[row, : len(sample["input_ids"])] = 1
    return input_ids, attention_mask


class SequenceLabelCollator:
    """Fine-tuning batches: padded ``input_ids``/``attention_mask`` and one label per sequence."""

    def __init__(self, task: str, pad_to_multiple_of=None):
        self.dtype = torch.float32 if task == "regression" else torch.int64
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples) -> dict:
        input_ids, attention_mask = _padded(samples, self.pad_to_multiple_of)
        labels = torch.tensor([s["label"] for s in samples], dtype=self.dtype)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PredictCollator:
    """Prediction batches: padded, nothing masked, with each sequence's row and id to write next to its output."""

    def __init__(self, pad_to_multiple_of=None):
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples) -> dict:
        input_ids, attention_mask = _padded(samples, self.pad_to_multiple_of)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "sample_index": torch.tensor([s["sample_index"] for s in samples], dtype=torch.int64),
            "names": [s["name"] for s in samples],
        }


def codon_masker(seed: int, mlm_probability: float) -> MLMMasker:
    """Special tokens (<CLS> <SEP> <UNK> <PAD> <MASK>, ids 0..4) are never selected; random replacements are codons
    (ids 5..68)."""
    return MLMMasker(
        MASK_ID, range(FIRST_CODON_ID), seed, mlm_probability, random_token_ids=(FIRST_CODON_ID, VOCAB_SIZE)
    )


# ------------------------------------------------------------------------------------------------- the module


class CodonDataModule(lightning.LightningDataModule):
    """See the module docstring. ``dp_rank``/``dp_world_size`` override the trainer's ranks (use without a Trainer)."""

    def __init__(self, data_cfg, dp_rank: int | None = None, dp_world_size: int | None = None):
        super().__init__()
        self.cfg = resolve_data_config(data_cfg)
        self._dp = None if dp_rank is None else (int(dp_rank), int(dp_world_size or 1))
        self.train_data: CodonSequences | None = None
        self.train_rows = self.val_rows = None
        self.val_data: CodonSequences | None = None
        self.predict_data: CodonSequences | None = None
        self.num_classes = self.cfg["num_classes"]
        # Set by callbacks.PerRankDataPosition when a checkpoint of another number of ranks is resumed: the saved
        # ranks' sampler positions, which the next training loader's sampler continues (EpochBatchSampler.continue_from).
        self.continue_data_from: list[dict] | None = None

    # -- ranks

    def dp_rank_and_world_size(self) -> tuple[int, int]:
        if self._dp is not None:
            return self._dp
        trainer = self._trainer_or_none()
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _trainer_or_none(self):
        return getattr(self, "trainer", None)

    def _check_trainer(self) -> None:
        trainer = self._trainer_or_none()
        connector = getattr(trainer, "_accelerator_connector", None)
        if trainer is not None and trainer.world_size > 1 and getattr(connector, "use_distributed_sampler", False):
            raise ConfigError(
                "CodonDataModule shards the data per rank itself: build the Trainer with use_distributed_sampler=False"
            )

    # -- reading

    def _read(self, key: str, labels: bool) -> CodonSequences:
        cfg = self.cfg
        return read_sequences(
            cfg[key],
            sequence_column=cfg["sequence_column"],
            label_column=cfg["label_column"] if labels else None,
            invalid_codon_policy=cfg["invalid_codon_policy"],
            max_codons=cfg["max_codons"],
            task=cfg["task"],
            key=f"data.{key}",
        )

    def setup(self, stage: str | None = None) -> None:
        self._check_trainer()
        labels = self.cfg["task"] != "mlm"
        if stage in (None, "fit", "validate") and self.train_data is None:
            if not self.cfg["train_path"]:
                raise ConfigError("data.train_path is not set: point it at the training sequences (file or directory)")
            self.train_data = self._read("train_path", labels)
            if self.cfg["val_path"]:
                self.val_data = self._read("val_path", labels)
                self.train_rows, self.val_rows = np.arange(len(self.train_data)), np.arange(len(self.val_data))
            else:
                self.val_data = self.train_data
                self.train_rows, self.val_rows = split_rows(
                    len(self.train_data), float(self.cfg["val_fraction"]), self.cfg["seed"]
                )
            if self.cfg["task"] == "classification":
                self._check_classes()
        if stage in (None, "predict") and self.predict_data is None and self.cfg["predict_path"]:
            self.predict_data = self._read("predict_path", labels=False)

    def _check_classes(self) -> None:
        seen = max(int(self.train_data.labels.max()), int(self.val_data.labels.max())) + 1
        if self.num_classes is None:
            self.num_classes = max(seen, 2)
        elif seen > self.num_classes:
            raise ConfigError(
                f"a label is {seen - 1}, but data.num_classes={self.num_classes} allows 0..{self.num_classes - 1}; "
                "raise data.num_classes or fix the labels"
            )

    # -- loaders

    def _batching(self) -> dict:
        if self.cfg["input_format"] == "thd":
            return {"token_budget": self.cfg["token_budget"]}
        return {"micro_batch_size": self.cfg["micro_batch_size"]}

    def _collator(self):
        if self.cfg["task"] != "mlm":
            return SequenceLabelCollator(self.cfg["task"], self.cfg["pad_to_multiple_of"])
        masker = codon_masker(self.cfg["seed"], float(self.cfg["mlm_probability"]))
        kind = THDCollator if self.cfg["input_format"] == "thd" else BSHDCollator
        return kind(masker, PAD_ID, self.cfg["pad_to_multiple_of"])

    def _loader(self, dataset, batch_sampler, collate_fn) -> StatefulDataLoader:
        with warnings.catch_warnings():
            # torchdata calls torch.set_vital, which torch 2.13 deprecates: a warning no user can act on.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            return StatefulDataLoader(
                dataset,
                batch_sampler=batch_sampler,
                collate_fn=collate_fn,
                num_workers=self.cfg["num_workers"],
                pin_memory=bool(self.cfg["pin_memory"]) and torch.cuda.is_available(),
            )

    def _require(self, data, what: str):
        if data is None:
            raise ConfigError(f"CodonDataModule has no {what} data: call setup() first (Lightning does)")
        return data

    def train_dataloader(self) -> StatefulDataLoader:
        """Endless, resumable batches of this rank's share of the training rows (see the module docstring)."""
        data = self._require(self.train_data, "training")
        rank, world = self.dp_rank_and_world_size()
        sampler = TrainBatchSampler(
            self.train_rows, data.lengths, shuffle=True, dp_rank=rank, dp_world_size=world, seed=self.cfg["seed"],
            **self._batching(),
        )  # fmt: skip
        if self.continue_data_from is not None:
            states, self.continue_data_from = self.continue_data_from, None
            try:
                logger.warning("Resuming on another number of ranks: %s", sampler.continue_from(states))
            except ValueError as err:
                logger.warning("Resuming on another number of ranks: the data order starts afresh (%s)", err)
        return self._loader(CodonSamples(data), sampler, self._collator())

    def val_batches(self) -> list[list[tuple[int, int]]]:
        """This rank's validation batches of ``(0, row)``: every rank takes ``len(val_rows) // world`` rows (rank r:
        every world-th row from r; fewer than ``world`` rows are left out) and the same number of batches."""
        data = self._require(self.val_data, "validation")
        rank, world = self.dp_rank_and_world_size()
        n_per_rank = len(self.val_rows) // world
        if len(self.val_rows) and not n_per_rank:
            raise ConfigError(f"{len(self.val_rows)} validation sequences cannot feed {world} ranks; use more")
        if len(self.val_rows) % world:
            logger.info("validation leaves out %d of %d sequences (equal shares for %d ranks)",
                        len(self.val_rows) % world, len(self.val_rows), world)  # fmt: skip
        shares = [self.val_rows[r::world][:n_per_rank] for r in range(world)]
        batches = equal_count_batches(shares, data.lengths, **self._batching())[rank] if n_per_rank else []
        return [[(0, int(row)) for row in batch] for batch in batches]

    def val_dataloader(self):
        """Fixed validation batches of this rank (an empty list, which Lightning skips, when there are none)."""
        batches = self.val_batches()
        if not batches:
            return []
        return self._loader(CodonSamples(self.val_data), batches, self._collator())

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        """Unmasked, padded batches of ``micro_batch_size`` sequences of ``predict_path``, in file order; rank r takes
        the r-th contiguous share (every sequence on exactly one rank)."""
        if not self.cfg["predict_path"]:
            raise ConfigError("data.predict_path is not set: point it at the sequences to predict")
        data = self._require(self.predict_data, "prediction")
        rank, world = self.dp_rank_and_world_size()
        rows = np.array_split(np.arange(len(data)), world)[rank]
        dataset = torch.utils.data.Subset(CodonSamples(data, with_names=True), rows.tolist())
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.cfg["micro_batch_size"],
            shuffle=False,
            collate_fn=PredictCollator(self.cfg["pad_to_multiple_of"]),
            num_workers=self.cfg["num_workers"],
        )

    def batches_per_epoch(self) -> int:
        """Training batches in one data epoch of this rank (BSHD: exact; THD: in epoch 0), for logs and schedules."""
        data = self._require(self.train_data, "training")
        rank, world = self.dp_rank_and_world_size()
        n_rows = len(self.train_rows) // world
        if self.cfg["input_format"] == "bshd":
            return math.ceil(n_rows / self.cfg["micro_batch_size"])
        sampler = EpochBatchSampler(self.train_rows, data.lengths, dp_rank=rank, dp_world_size=world,
                                    seed=self.cfg["seed"], token_budget=self.cfg["token_budget"])  # fmt: skip
        count = 0
        for batch in sampler:
            if batch[0][0] > 0:
                return count
            count += 1
        return count
