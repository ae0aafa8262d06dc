"""Lightning callbacks: what this recipe adds to Lightning's loop, each at the hook Lightning provides for it.

- :class:`PerfCallback`: loss, gradient norm, learning rate, unpadded tokens/s per GPU, MFU, step time and peak memory
  into ``metrics.jsonl`` and ``summary.json`` (perf_logger.py: the numbers and format every recipe of this project
  writes, which ci/benchmark.py reads), with a progress bar on a terminal and one plain line per logging step
  elsewhere (a log file, SLURM); validation results into ``val_metrics.jsonl`` and the summary.
- :class:`PerRankDataPosition`: every rank's position in its share of the training data, in the checkpoint that only
  rank 0 writes, so that each rank resumes at its own next batch.
- :class:`ExportCallback`: the trained model as a Hugging Face directory, ``<output_dir>/final_model``, that
  ``AutoModelForMaskedLM.from_pretrained(dir, trust_remote_code=True)`` loads anywhere (no FP8 settings, backend auto).
"""

import json
import logging
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from epoch_batch_sampler import EpochBatchSampler
from hf_export import write_hf_directory
from omegaconf import DictConfig
from perf_logger import PerfLogger, drop_metrics_after, quiet_progress_bars_off_a_terminal
from recipe_paths import RECIPE_DIR


logger = logging.getLogger(__name__)

VAL_METRICS = "val_metrics.jsonl"


class PerfCallback(L.Callback):
    """Feeds :class:`perf_logger.PerfLogger` once per micro-batch (tokens) and once per optimizer step (loss, norm).

    Nothing here waits for the GPU: the counters stay on the device and are read every ``logger.log_every`` steps.
    """

    def __init__(self, cfg: DictConfig, config_name: str = ""):
        self.cfg, self.config_name = cfg, config_name
        self.perf: PerfLogger | None = None
        self._step_loss: torch.Tensor | None = None
        self._last_step = 0
        self._lr = float("nan")
        self._val: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        quiet_progress_bars_off_a_terminal()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After a resume global_step is the checkpoint's step: metrics.jsonl keeps the lines up to it.
        self._last_step = trainer.global_step
        self.perf = PerfLogger(
            self.cfg,
            pl_module.model_flops,
            pl_module.model_config.pad_token_id,
            trainer.global_step,
            config_name=self.config_name,
        )
        if trainer.is_global_zero:
            drop_metrics_after(Path(self.cfg.output_dir) / VAL_METRICS, trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.perf.count_batch(batch)  # the batch is on the device already: a few tensor ops, no sync

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler steps after it)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # outputs["loss"] is training_step's loss divided by accumulate_grad_batches (Lightning 2.6 passes
        # on_train_batch_end its detached copy). Pre-training weights it by this rank's share of the micro-batch's
        # masked codons on all ranks (lightning_module.py), so the sum over the step's micro-batches, averaged over
        # the ranks by PerfLogger, is the average of the micro-batches' means over their masked codons on all ranks:
        # the loss whose gradient the step takes. On one process it is the plain mean, as in benchmark_bare_loop.py.
        loss = outputs["loss"].detach()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if trainer.global_step > self._last_step:  # this batch ended an optimizer step
            self.perf.log_step(trainer.global_step, self._step_loss, pl_module.last_grad_norm, self._lr)
            self._step_loss, self._last_step = None, trainer.global_step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        found = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        if not found or not trainer.is_global_zero:
            return
        self._val = {"step": trainer.global_step, **found}
        with open(Path(self.cfg.output_dir) / VAL_METRICS, "a") as file:
            file.write(json.dumps(self._val) + "\n")
        logger.info(
            "validation at step %d | %s", trainer.global_step, " | ".join(f"{k} {v:.4f}" for k, v in found.items())
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.perf is None:
            return
        summary = self.perf.finish()  # rank 0 writes summary.json; None elsewhere
        if summary is None:
            return
        summary.update(
            strategy=self.cfg.strategy,
            precision=trainer.precision,
            fp8_layers=[i + 1 for i, p in enumerate(pl_module.model_config.layer_precision or []) if p == "fp8"],
            final_val=self._val or None,
        )
        (Path(self.cfg.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


class PerRankDataPosition(L.Callback):
    """Lightning saves the training loader's ``state_dict()`` in the checkpoint (``loops.fit_loop.state_dict.
    combined_loader``), but the checkpoint is rank 0's, and on resume every rank loads rank 0's position. Ranks read
    different shares and, with THD packing, different numbers of sequences per batch: each rank's own position is
    needed. At save (every rank builds the checkpoint dict) the positions are gathered into ``per_rank_loader_states``;
    at load each rank puts its own back where Lightning will read it, before the loader is created.
    """

    KEY = "per_rank_loader_states"

    @staticmethod
    def _loader_states(checkpoint: dict) -> dict | None:
        return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = self._loader_states(checkpoint)
        if state is None or trainer.world_size == 1:
            return
        gathered = [None] * trainer.world_size
        dist.all_gather_object(gathered, state.get("combined_loader"))
        checkpoint[self.KEY] = gathered

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = self._loader_states(checkpoint)
        saved = checkpoint.get(self.KEY)
        if state is None or (saved is None and trainer.world_size == 1):
            return
        if saved is None or len(saved) != trainer.world_size:
            saved = saved or [state.get("combined_loader")]  # a one-rank run's own position
            logger.warning(
                "The checkpoint was written by %d rank(s), this run has %d: weights, optimizer and schedule resume, "
                "the data continues the epoch where it can (see the next line) and the random streams start afresh",
                len(saved),
                trainer.world_size,
            )
            state.pop("combined_loader", None)
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is not None and hasattr(datamodule, "continue_data_from"):
                # Each rank's combined_loader is a list of loader states, the training loader's first.
                datamodule.continue_data_from = [
                    EpochBatchSampler.position_in((loaders or [None])[0]) or {} for loaders in saved
                ]
            return
        state["combined_loader"] = saved[trainer.global_rank]


class ExportCallback(L.Callback):
    """At the end of training, before the strategy tears down: gather the full weights (a collective for FSDP and
    FSDP2, Lightning's ``lightning_module_state_dict``) and write them on rank 0 with ``hf_export.write_hf_directory``
    (staged, then renamed: an interrupted export never replaces a good one)."""

    def __init__(self, cfg: DictConfig):
        self.output_dir = Path(cfg.output_dir) / "final_model"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # full on rank 0 (empty elsewhere for FSDP)
        if trainer.is_global_zero:
            prefix = "model."  # the LightningModule holds the Hugging Face model as `self.model`
            weights = {k.removeprefix(prefix): v.detach().cpu() for k, v in state.items() if k.startswith(prefix)}
            write_hf_directory(pl_module.model, self.output_dir, state_dict=weights, tokenizer=export_tokenizer())
            logger.info("Exported the trained model to %s", self.output_dir)
        trainer.strategy.barrier("export")


def export_tokenizer():
    """The recipe's codon tokenizer (tokenizer/, from the model package), shipped inside every export."""
    from transformers import AutoTokenizer

    directory = RECIPE_DIR / "tokenizer"
    return AutoTokenizer.from_pretrained(directory) if directory.is_dir() else None
