"""Validation loss and perplexity on a held-out file, every ``validation.every_n_steps`` optimizer steps.

The loss is token-weighted over the whole validation set: the summed negative log-likelihood of every scored token on
every rank, divided by the number of scored tokens (the training windows and label rules: degenerate bases are not
scored, soft-masked bases are scored as uppercase). The same batches are used every time, so the curve shows the
model changing, not the sample.

Every rank runs the same number of forward passes, because under FSDP2 each forward gathers weights collectively: a
rank with fewer batches repeats one with weight 0. Under context parallelism the ranks of a CP group read the same
batches, each runs its shard, and the group's first rank counts the result. Nothing here catches exceptions: a validation file that cannot be
read stops the run at the first evaluation, instead of producing a training curve with silent holes.
"""

import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from collator import pad_token_id
from context_parallel import context_parallel_batch, shard_for_context_parallel
from dataset import validation_batches
from distributed import move_to_device
from grad_accumulation import count_targets
from user_errors import ConfigError


logger = logging.getLogger(__name__)


def perplexity(mean_nll: float) -> float:
    """exp(NLL), capped so that a diverged run logs a large number instead of overflowing."""
    return math.exp(min(mean_nll, 50.0))


class Validator:
    """Evaluates the model on ``validation.path`` (None: never) and appends the result to ``validation.jsonl``.

    Args:
        val_cfg: the ``validation`` config group (``path``, ``every_n_steps``, ``max_batches``).
        data_cfg: the ``dataset`` group; its windowing and label settings apply to the validation file too.
        cp_size, cp_rank: context parallelism (train_cp.py): this rank's place in its CP group.
    """

    def __init__(
        self,
        val_cfg,
        data_cfg,
        tokenizer,
        dp_rank: int,
        dp_world_size: int,
        device,
        output_dir,
        wandb_mode,
        cp_size: int = 1,
        cp_rank: int = 0,
    ):
        self.path = val_cfg.path
        self.every_n_steps = int(val_cfg.every_n_steps)
        self.max_batches = val_cfg.max_batches
        self.data_cfg, self.tokenizer = data_cfg, tokenizer
        self.dp_rank, self.dp_world_size, self.device = dp_rank, dp_world_size, device
        self.output_file = Path(output_dir) / "validation.jsonl"
        self.wandb_mode = wandb_mode
        self.cp_size, self.cp_rank = cp_size, cp_rank
        if self.path is not None and self.every_n_steps < 1:
            raise ConfigError(
                f"validation.every_n_steps must be >= 1 when validation.path is set, got {self.every_n_steps}"
            )

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every_n_steps == 0

    def _placeholder_batch(self) -> dict:
        """What a rank without validation data runs so that collectives line up: <bos><eos>, nothing scored."""
        ids = torch.tensor([[self.tokenizer.bos_token_id, self.tokenizer.eos_token_id]])
        cu = torch.tensor([0, 2], dtype=torch.int32)
        return {
            "input_ids": ids,
            "labels": torch.full_like(ids, -100),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu.clone(),
        }

    @torch.no_grad()
    def run(self, model: torch.nn.Module, step: int) -> dict:
        """Evaluate (collective: every rank calls it); returns the metrics on every rank."""
        was_training = model.training
        model.eval()
        batches = list(
            validation_batches(
                self.data_cfg, self.tokenizer, self.path, self.dp_rank, self.dp_world_size, self.max_batches
            )
        )
        passes = torch.tensor(len(batches), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [summed NLL, scored tokens]
        for index in range(int(passes)):
            real = index < len(batches)
            batch = batches[index] if real else (batches[-1] if batches else self._placeholder_batch())
            if self.cp_size > 1:
                batch = context_parallel_batch(batch, self.cp_size, pad_token_id(self.tokenizer))
                loss = model(
                    **move_to_device(shard_for_context_parallel(batch, self.cp_rank, self.cp_size), self.device)
                ).loss
            else:
                loss = model(**move_to_device(batch, self.device)).loss
            if real and self.cp_rank == 0:  # the loss is the CP group's mean: count it once per group
                scored = count_targets(batch, causal_lm=True)
                totals += torch.stack([loss.double() * scored, torch.tensor(scored, device=self.device).double()])
        if dist.is_initialized():
            dist.all_reduce(totals)
        nll_sum, tokens = totals.tolist()
        if tokens == 0:
            raise ConfigError(f"validation file {self.path} has no scored tokens (empty, or only degenerate bases)")
        metrics = {"step": step, "val_loss": nll_sum / tokens, "val_perplexity": perplexity(nll_sum / tokens)}
        metrics["val_tokens"] = int(tokens)
        model.train(was_training)
        if self.dp_rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            self._record(metrics)
        return metrics

    def _record(self, metrics: dict) -> None:
        logger.info(
            "validation step %d: loss %.4f, perplexity %.3f",
            metrics["step"],
            metrics["val_loss"],
            metrics["val_perplexity"],
        )
        self.output_file.parent.mkdir(parents=True, exist_ok=True)
        with self.output_file.open("a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        if self.wandb_mode != "disabled":
            import wandb  # only when W&B is on: the recipe runs without it installed

            if wandb.run is not None:
                wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
