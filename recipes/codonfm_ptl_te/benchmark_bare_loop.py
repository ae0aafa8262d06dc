"""The Lightning overhead, measured: train.py's model on train.py's batches with a plain PyTorch loop (one device).

    python benchmark_bare_loop.py --config-name encodon_80m data.train_path=../../../shared/data/codon_sample.parquet \
        num_train_steps=100
    python3 ci/benchmark.py --recipe recipes/codonfm_ptl_te --entrypoint benchmark_bare_loop.py --config encodon_80m ...

Takes the same Hydra configs as train.py and builds the same things with the same functions: the model
(model_setup.py: config, FP8 plan, construction on the device), the datamodule's training loader (the same batches
in the same order), AdamW with its two parameter groups (weight_decay.py) and the schedule, bf16 autocast for
``trainer.precision: bf16-mixed`` (Lightning's ``MixedPrecision`` does the same), gradient clipping, and
perf_logger.py's ``PerfLogger``, which writes ``summary.json`` in the format train.py writes. The loss is the same
too: each micro-batch's masked-codon mean divided by ``trainer.accumulate_grad_batches``; on one process the
LightningModule's data-parallel token weight is exactly 1 and reduces nothing (lightning_module.py), so there is none
here. What is left out is Lightning itself: the Trainer's
loop, hooks, callbacks, ``self.log`` and the per-micro-batch dropout seeding of lightning_module.py. Compare the two summaries'
``median_tokens_per_second_per_gpu`` (docs/benchmarks.md). No checkpoints, no validation, no export.
"""

import contextlib
import logging

import hydra
import torch
from datamodule import CodonDataModule
from model_setup import build_model, check_backend, is_pretraining, load_model_config, model_flops
from omegaconf import DictConfig, OmegaConf
from packing import with_labeled_token_index
from perf_logger import PerfLogger, quiet_progress_bars_off_a_terminal
from quantization import check_quantization_supported
from recipe_paths import config_name
from scheduler import get_linear_schedule_with_warmup
from user_errors import ConfigError, check_config, report_user_errors
from weight_decay import weight_decay_groups


logger = logging.getLogger(__name__)


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    quiet_progress_bars_off_a_terminal()
    if not is_pretraining(cfg) or cfg.strategy != "ddp" or cfg.trainer.devices not in ("auto", 1):
        raise ConfigError("benchmark_bare_loop.py measures masked-LM pre-training on one device (strategy=ddp)")
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(cfg.seed)

    config, plan = load_model_config(cfg)
    check_backend(config)
    check_quantization_supported(plan, device)
    model = build_model(config, plan, pretraining=True, device=device)
    flops = model_flops(model, config)
    groups = weight_decay_groups(model, cfg.adamw_kwargs.weight_decay)
    optimizer = torch.optim.AdamW(groups, **cfg.adamw_kwargs, fused=device.type == "cuda")
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    data = CodonDataModule(cfg.data, dp_rank=0, dp_world_size=1)
    data.setup("fit")
    batches = iter(data.train_dataloader())

    bf16 = cfg.trainer.precision == "bf16-mixed"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    accumulate = int(cfg.trainer.accumulate_grad_batches)
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
    perf = PerfLogger(cfg, flops, config.pad_token_id, config_name=config_name())
    model.train()
    for step in range(1, cfg.num_train_steps + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(accumulate):
            batch = with_labeled_token_index(next(batches))  # as the LightningModule does, before the copy
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            perf.count_batch(batch)
            with autocast:
                loss = model(**batch, labeled_logits_only=True).loss / accumulate
            loss.backward()
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        perf.log_step(step, step_loss, grad_norm, lr)
    summary = perf.finish()
    if summary is not None:
        logger.info("bare loop: %.0f tokens/s/gpu (median)", summary["median_tokens_per_second_per_gpu"])


if __name__ == "__main__":
    main()
