# Copied from common/validation.py — edit the source, then run ci/check_copies.py --fix
"""Held-out loss and perplexity every ``validation.every_n_steps`` optimizer steps, appended to ``validation.jsonl``.

The loss is token-weighted over the whole held-out set: the summed negative log-likelihood of every scored token on
every rank, divided by the number of scored tokens (masked LM: the masked tokens; causal LM: every next token the
training labels score). Each recipe's ``dataset.py`` says which batches those are (``HeldOutBatches``): the same
ones at every evaluation (masked-LM masks drawn from a fixed seed), so the curve shows the model changing, not the
sample.

Every rank runs the same number of forward passes, because FSDP2 and Megatron-FSDP gather weights collectively in
every forward: a rank with fewer batches repeats one with weight 0 (or runs the recipe's placeholder batch, which
scores nothing, if it has none). Under context parallelism the ranks of a CP group read the same full batches, each
runs its own share, and the group's first rank counts the result (the model's loss is already the group's mean).
Nothing here catches exceptions: data that cannot be read stops the run, instead of producing a training curve with
silent holes.
"""

import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import move_to_device
from grad_accumulation import count_targets
from perf_logger import drop_metrics_after
from user_errors import ConfigError


logger = logging.getLogger(__name__)


def perplexity(mean_nll: float) -> float:
    """exp(NLL), capped so that a diverged run logs a large number instead of overflowing."""
    return math.exp(min(mean_nll, 50.0))


@dataclass
class HeldOutBatches:
    """One data-parallel rank's held-out data, as a recipe's ``dataset.py`` builds it.

    Attributes:
        read: returns this rank's batches, full (before a context-parallel split) and the same at every call.
        placeholder: a batch shaped like them that scores nothing, for a rank that has none left to run.
        causal_lm: how the scored tokens are counted (``grad_accumulation.count_targets``).
        description: what was read, for the log (e.g. "120 sequences of valid.fasta on this rank").
    """

    read: Callable[[], Iterable[dict]]
    placeholder: dict
    causal_lm: bool
    description: str = ""


class Validator:
    """Evaluates the model on ``validation.path`` (None: never) and records the metrics.

    Args:
        val_cfg: the ``validation`` config group (``path``, ``every_n_steps``, ``max_batches``: per rank, None = all).
        held_out: builds this rank's ``HeldOutBatches`` from ``val_cfg.path``; called once, here, when a path is set,
            so a missing file or a bad row stops the run before it trains.
        dp_rank: this rank's data-parallel rank (the ranks of a CP group share it).
        output_dir: where ``validation.jsonl`` is appended (by global rank 0).
        wandb_mode: the ``wandb.mode`` setting; when not "disabled", the metrics also go to the active W&B run.
        cp_size, cp_rank: context parallelism: each rank runs its share of every full batch.
        autocast_bf16: run the forward under ``torch.autocast`` to bf16, as a DDP training step over fp32 weights does
            (FSDP2 and Megatron-FSDP cast the weights themselves).
        forward_kwargs: further arguments of every forward, as the training loop passes them (Geneformer's
            ``labeled_logits_only=True``: the MLM head on the masked tokens only).
    """

    def __init__(
        self,
        val_cfg,
        held_out: Callable[[str], HeldOutBatches],
        *,
        dp_rank: int,
        device: torch.device,
        output_dir,
        wandb_mode: str = "disabled",
        cp_size: int = 1,
        cp_rank: int = 0,
        autocast_bf16: bool = False,
        forward_kwargs: dict | None = None,
    ):
        self.path = val_cfg.path
        self.every_n_steps = int(val_cfg.every_n_steps)
        self.max_batches = val_cfg.max_batches
        self.dp_rank, self.device = dp_rank, device
        self.output_file = Path(output_dir) / "validation.jsonl"
        self.wandb_mode = wandb_mode
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.autocast_bf16 = autocast_bf16
        self.forward_kwargs = dict(forward_kwargs or {})
        if self.path is None:
            self.data = None
            return
        if not str(self.path).strip():
            raise ConfigError("validation.path is empty; give a held-out file, glob or directory, or null for none")
        if self.every_n_steps < 1:
            raise ConfigError(
                f"validation.every_n_steps must be >= 1 when validation.path is set, got {self.every_n_steps}"
            )
        if self.max_batches is not None and int(self.max_batches) < 1:
            raise ConfigError(f"validation.max_batches must be >= 1 or null (all), got {self.max_batches}")
        self.data = held_out(str(self.path))
        if self.data.description:
            logger.info("Validation data: %s", self.data.description)

    def resume_at(self, step: int) -> None:
        """A run resumed from checkpoint ``step`` validates the steps after it again: drop their rows (global rank 0),
        written by the job that died before its next checkpoint, so ``validation.jsonl`` holds each step once."""
        if step > 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            drop_metrics_after(self.output_file, step)

    @property
    def enabled(self) -> bool:
        return self.data is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every_n_steps == 0

    def _forward_loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        if self.cp_size > 1:
            # Imported here: only the recipes with context parallelism ship context_parallel.py.
            from context_parallel import shard_for_context_parallel

            batch = shard_for_context_parallel(batch, self.cp_rank, self.cp_size)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            return model(**move_to_device(batch, self.device), **self.forward_kwargs).loss

    @torch.no_grad()
    def run(self, model: torch.nn.Module, step: int) -> dict:
        """Evaluate (collective: every rank calls it); returns the metrics on every rank."""
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        batches = list(islice(self.data.read(), self.max_batches))
        passes = torch.tensor(len(batches), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [summed NLL, scored tokens]
        for index in range(int(passes)):
            real = index < len(batches)
            batch = batches[index] if real else (batches[-1] if batches else self.data.placeholder)
            loss = self._forward_loss(model, batch)
            scored = count_targets(batch, causal_lm=self.data.causal_lm)
            if real and self.cp_rank == 0 and scored:  # the loss is the CP group's mean: count it once per group
                totals += torch.stack([loss.double() * scored, torch.tensor(scored, device=self.device).double()])
        if dist.is_initialized():
            dist.all_reduce(totals)
        model.train(was_training)
        nll_sum, tokens = totals.tolist()
        if tokens == 0:
            raise ConfigError(f"validation data {self.path} has no scored tokens; point validation.path at real data")
        metrics = {
            "step": step,
            "val_loss": nll_sum / tokens,
            "val_perplexity": perplexity(nll_sum / tokens),
            "val_tokens": int(tokens),
        }
        if not dist.is_initialized() or dist.get_rank() == 0:
            self._record(metrics, time.perf_counter() - started)
        return metrics

    def _record(self, metrics: dict, seconds: float) -> None:
        logger.info(
            "validation step %d: loss %.4f, perplexity %.3f (%d scored tokens, %.1f s)",
            metrics["step"],
            metrics["val_loss"],
            metrics["val_perplexity"],
            metrics["val_tokens"],
            seconds,
        )
        self.output_file.parent.mkdir(parents=True, exist_ok=True)
        with self.output_file.open("a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        if self.wandb_mode != "disabled":
            import wandb  # only when W&B is on: the recipe runs without it installed

            if wandb.run is not None:
                wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
