"""Pre-train Llama 3 on OpenGenome2-style metagenomes with DistributedDataParallel: every GPU holds the whole model.

    python train_ddp.py                                            # one process (CPU or GPU): the L0 sanity config
    python train_ddp.py --config-name og2_1b_thd dataset.path='/data/og2/train/*.jsonl.gz' validation.path=null
    torchrun --nproc_per_node=8 train_ddp.py --config-name og2_1b_thd dataset.path=... validation.path=...

For models that fit on one GPU with their fp32 weights, gradients and optimizer state (the 1B shape: ~16 GB of the
three plus activations). On one GPU it runs the model without any wrapper, and skips the copies that one-rank FSDP2
makes (llama3_native_te's train_ddp.py ran 1.1% faster than its train_fsdp2.py on one H100; docs/benchmarks.md); the
7B configs need train_fsdp2.py. The same configs, data,
optimizer groups, init switches and checkpoints' contents as train_fsdp2.py; FSDP2's keys (``fsdp.*``) are not used,
and DDP checkpoints are written synchronously by rank 0 (``checkpoint.async_save`` applies to FSDP2's).

Reads top to bottom: set up processes, build and wrap the model (``model_setup.build_model``), optimizer (weight-decay
groups), schedule, streaming data, resume, train (gradient accumulation, clipping, validation every N steps), export.
Every key it reads is documented in hydra_config/defaults.yaml.
"""

import logging
from pathlib import Path

import hydra
import torch
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from collator import pad_token_id
from compensated_adamw import master_state_dict
from dataset import create_dataloader, held_out_batches
from distributed import cleanup_distributed, move_to_device, setup_distributed
from fp8_calibration import calibrate_on_first_batch
from grad_accumulation import count_targets, step_token_weights
from grad_clipping import clip_grad_norm_and_step
from mixed_precision import computes_in_bf16, holds_masters_in_optimizer
from model_setup import build_model
from omegaconf import DictConfig, OmegaConf
from optimizer import build_optimizer
from perf_logger import PerfLogger, Profiler, quiet_progress_bars_off_a_terminal
from recipe_paths import config_name, tokenizer_source
from scheduler import get_linear_schedule_with_warmup
from transformers import AutoTokenizer
from user_errors import check_config, report_user_errors
from validation import Validator


logger = logging.getLogger(__name__)


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)  # a `???` value left unset or a mistyped override (num_train_steps=abc) fails here, by name
    quiet_progress_bars_off_a_terminal()  # in a log file a bar is one endless line
    dist_config, device = setup_distributed()
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))

    # Model: built on the device from cfg.seed (with the init switches of model_config_overrides: Spike-No-More
    # embeddings, depth-scaled output projections), the same weights on every rank; wrapped in DDP under torchrun.
    # fp32 master weights, computed under bf16 autocast.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(cfg.tokenizer_path))
    built = build_model(cfg, device, meshes=None, strategy="ddp")
    model = built.model
    use_bf16 = computes_in_bf16(cfg.mixed_precision, device)

    # Optimizer with weight-decay groups, schedule, streaming data (each data-parallel rank reads its own part).
    optimizer = build_optimizer(model, cfg, device, built.master_low_bits)  # CompensatedAdamW on CUDA (adamw.py)
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    dataloader = create_dataloader(
        cfg.dataset, tokenizer, dp_rank=dist_config.rank, dp_world_size=dist_config.world_size, seed=cfg.seed
    )
    validator = Validator(
        cfg.validation,
        lambda path: held_out_batches(path, cfg.dataset, tokenizer, dist_config.rank, dist_config.world_size),
        dp_rank=dist_config.rank,
        device=device,
        output_dir=cfg.output_dir,
        wandb_mode=cfg.wandb.mode,
        autocast_bf16=use_bf16,
    )

    # Resume from the newest complete checkpoint (model, optimizer, schedule, data cursor, RNG streams). The model
    # config goes beside the checkpoints, so scripts/evaluate_fasta_lm_loss.py can rebuild the model from one.
    if cfg.checkpoint.async_save:
        logger.info("checkpoint.async_save is for FSDP2's checkpoints: train_ddp.py's are written by rank 0, in step")
    checkpointer = Checkpointer(cfg.checkpoint.ckpt_dir, "ddp", max_checkpoints=cfg.checkpoint.max_checkpoints)
    if cfg.checkpoint.resume:
        start_step = checkpointer.load_latest(model, optimizer, scheduler, dataloader, map_location=device)
    else:
        start_step = checkpointer.start_afresh()  # refuses an earlier run's checkpoints
    validator.resume_at(start_step)  # the steps after it are validated again
    if dist_config.is_main_process():  # after resuming: a run refused for another model shape leaves it as it was
        built.config.save_pretrained(Path(cfg.checkpoint.ckpt_dir) / "model_config")
    with torch.random.fork_rng(devices=[]):  # making the iterator draws from the RNG; keep resumed runs identical
        batches = iter(dataloader)

    perf = PerfLogger(cfg, built.model_flops, pad_token_id(tokenizer), start_step, config_name=config_name())
    profiler = Profiler(cfg.profiler, cfg.output_dir)
    built.train_model.train()

    def first_batch_loss(batch):  # as the loop computes a micro-batch's loss
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            return built.train_model(**move_to_device(batch, device)).loss

    # DelayedScaling: every FP8 scale set on the first batch before step 1, instead of the first steps' gradients being
    # cast with scales of 1 (fp8_calibration.py); the passes' gradients are discarded and the RNG state kept.
    batches = calibrate_on_first_batch(
        cfg.fp8_config.calibrate_delayed_scaling,
        built.plan.fp8_recipe,
        model,
        optimizer,
        batches,
        loss_of=first_batch_loss,
        grad_acc_steps=cfg.grad_acc_steps,
    )

    step = start_step
    for step in range(start_step + 1, cfg.num_train_steps + 1):
        with profiler.step_context(step):
            step_loss = torch.zeros((), device=device)
            # Weight each micro-batch by its share of the step's scored tokens on all DP ranks: k micro-batches then
            # give the gradient of one batch holding all of them, however the degenerate-base masking falls.
            micro_batches = [next(batches) for _ in range(cfg.grad_acc_steps)]
            weights = step_token_weights([count_targets(batch, causal_lm=True) for batch in micro_batches], device)
            for micro_step, batch in enumerate(micro_batches):
                batch = move_to_device(batch, device)
                perf.count_batch(batch)
                # Gradients are all-reduced only on the last micro-batch; earlier ones accumulate locally.
                with built.gradient_sync(micro_step == cfg.grad_acc_steps - 1):
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                        loss = built.train_model(**batch).loss * weights[micro_step]
                    loss.backward()
                step_loss += loss.detach()

            lr = scheduler.get_last_lr()[0]
            # Clips and steps; with bf16 weights the optimizer applies the clip factor as it reads the gradients.
            grad_norm = clip_grad_norm_and_step(optimizer, model.parameters(), cfg.max_grad_norm)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        perf.log_step(step, step_loss, grad_norm, lr)
        if validator.due(step):
            validator.run(built.train_model, step)
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            checkpointer.save(step, model, optimizer, scheduler, dataloader)

    if cfg.checkpoint.save_final and step > start_step:
        checkpointer.save(step, model, optimizer, scheduler, dataloader)
    perf.finish()

    # Export a Hugging Face directory that loads anywhere, without this recipe's low-precision settings.
    if cfg.export_final_model:
        if holds_masters_in_optimizer(cfg.mixed_precision, device):  # the fp32 masters, from the optimizer
            full_state_dict = {name: value.cpu() for name, value in master_state_dict(model, optimizer).items()}
        else:
            full_state_dict = gather_full_state_dict(model, "ddp")
        export_final_model(model, full_state_dict, Path(cfg.output_dir) / "final_model", tokenizer)
    checkpointer.close()
    cleanup_distributed()


if __name__ == "__main__":
    main()
