"""Hydra config -> ``transformers.TrainingArguments``: the one place where the recipe's keys meet the Trainer's.

Precision is not a Hydra key: it comes from the accelerate config (``mixed_precision``), which the Trainer reads
from the environment that ``accelerate launch`` sets up. ``bf16=True`` is passed only for bf16 and FP8 launches:
for FP8, launch_settings.py has already handed FP8 to the model and left accelerate with bf16 for everything else.
"""

import logging
from dataclasses import fields

import torch
from launch_settings import LaunchSettings
from omegaconf import DictConfig, OmegaConf
from transformers import TrainingArguments
from user_errors import ConfigError


logger = logging.getLogger(__name__)


def training_arguments(cfg: DictConfig, launch: LaunchSettings) -> TrainingArguments:
    adamw = cfg.adamw_kwargs
    betas = list(adamw.betas)
    if cfg.checkpoint.max_checkpoints is not None and cfg.checkpoint.max_checkpoints < 1:
        raise ConfigError("checkpoint.max_checkpoints must be >= 1 (or null to keep all)")
    if cfg.stop_after_steps is not None and cfg.stop_after_steps < 1:
        raise ConfigError(f"stop_after_steps must be a positive step number or null, got {cfg.stop_after_steps}")
    save_every = int(cfg.checkpoint.save_every)
    recipe_args = {
        "output_dir": str(cfg.output_dir),
        "max_steps": int(cfg.num_train_steps),
        "seed": int(cfg.seed),
        "gradient_accumulation_steps": int(cfg.grad_acc_steps),
        "max_grad_norm": float(cfg.max_grad_norm),
        # Optimizer: the Trainer's AdamW (fused on CUDA) with the recipe's hyperparameters; the schedule is
        # scheduler.py's (mlm_trainer.py), so the Trainer's own warmup/decay settings are unused.
        "optim": "adamw_torch_fused" if torch.cuda.is_available() and not launch.use_cpu else "adamw_torch",
        "learning_rate": float(adamw.lr),
        "adam_beta1": float(betas[0]),
        "adam_beta2": float(betas[1]),
        "adam_epsilon": float(adamw.eps),
        "weight_decay": float(adamw.weight_decay),
        "bf16": launch.precision in ("bf16", "fp8"),
        # Checkpoints: every save_every steps (and the last step, FinalCheckpointCallback); callbacks.py completes
        # and prunes them, so the Trainer's own limit stays off.
        "save_strategy": "steps" if save_every > 0 else "no",
        "save_steps": save_every if save_every > 0 else 500,
        "save_total_limit": None,
        # The dataloader position is restored from the checkpoint (checkpoints.py), not by skipping batches.
        "ignore_data_skip": True,
        "logging_steps": int(cfg.logger.log_every),
        # On: the Trainer reads every micro-batch's loss on the host (a GPU sync each time) to skip NaN/inf in its
        # logged average. Off: the loss logged is the true one, NaN included, and the host runs ahead of the GPU.
        "logging_nan_inf_filter": False,
        "report_to": "none",  # perf_logger.py writes metrics.jsonl/summary.json and, if enabled, W&B
        "disable_tqdm": True,  # perf_logger.py's bar (on a terminal) counts steps and shows loss and tokens/s
        "remove_unused_columns": False,  # THD batches carry cu_seq_lens_*/max_length_* for the model
        "use_cpu": launch.use_cpu or not torch.cuda.is_available(),
        "ddp_find_unused_parameters": False,
        "ddp_broadcast_buffers": False,  # rotary tables and the contact head's buffers never change
    }
    extra = OmegaConf.to_container(cfg.training_args)
    clash = sorted(set(extra) & set(recipe_args))
    if clash:
        raise ConfigError(
            f"training_args sets {clash}, which the recipe sets from its own keys (hydra_config/defaults)"
        )
    known = {f.name for f in fields(TrainingArguments)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"training_args has keys {unknown} that TrainingArguments does not have")
    return TrainingArguments(**recipe_args, **extra)
