"""Pre-train Llama 3 on DNA with context parallelism: every packed window is split over ``cp_size`` ranks (ring
attention in TransformerEngine), and FSDP2 shards the weights over all ranks. For windows too long for one GPU.

    torchrun --nproc_per_node=8 train_cp.py --config-name L0_sanity_cp cp_size=2
    torchrun --nproc_per_node=2 train_cp.py --config-name L0_sanity_cp model_config_overrides.backend=torch  # CPU

Reads top to bottom like train_fsdp2.py; what differs is the (dp, cp) mesh, the CP group handed to the model, and
the batches: the loader builds full context-parallel THD batches (every window padded to a multiple of
2 * cp_size, targets shifted before the split), and each rank keeps its own share of every window. The torch
backend runs the same numbers on CPU processes (all-gathered attention), which is how CI tests this script.
"""

import logging
from pathlib import Path

import hydra
import torch
from adamw import build_adamw
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from collator import pad_token_id
from context_parallel import shard_for_context_parallel
from dataset import create_dataloader, held_out_batches
from distributed import build_meshes, cleanup_distributed, move_to_device, setup_distributed
from fp8_calibration import calibrate_on_first_batch
from grad_accumulation import count_targets, step_token_weights
from grad_clipping import clip_grad_norm_and_step
from model_setup import build_model
from omegaconf import DictConfig, OmegaConf
from perf_logger import PerfLogger, Profiler, quiet_progress_bars_off_a_terminal
from recipe_paths import config_name, tokenizer_source
from scheduler import get_linear_schedule_with_warmup
from transformers import AutoTokenizer
from user_errors import ConfigError, check_config, report_user_errors
from validation import Validator


logger = logging.getLogger(__name__)


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity_cp", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)  # a `???` value left unset or a mistyped override (num_train_steps=abc) fails here, by name
    quiet_progress_bars_off_a_terminal()  # in a log file a bar is one endless line
    if cfg.cp_size < 2:
        raise ConfigError(f"train_cp.py needs cp_size >= 2 (got {cfg.cp_size}); for cp_size=1 use train_fsdp2.py")
    dist_config, device = setup_distributed(require_process_group=True)
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    torch.manual_seed(cfg.seed)
    meshes = build_meshes(dist_config, device, cp_size=cfg.cp_size)

    # The model as in train_fsdp2.py, sharded over all ranks (dp x cp: CP ranks hold the same weights, so sharding
    # over them too only saves memory), its attention split over this rank's CP group.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(cfg.tokenizer_path))
    built = build_model(cfg, device, meshes, strategy="fsdp2")
    model = built.model

    optimizer = build_adamw(model.parameters(), cfg, device)  # CompensatedAdamW on CUDA (adamw.py)
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    # All CP ranks of a DP group read the same windows; each keeps its own share of every batch below.
    dataloader = create_dataloader(
        cfg.dataset,
        tokenizer,
        dp_rank=meshes.dp_rank,
        dp_world_size=meshes.dp_size,
        seed=cfg.seed,
        cp_size=cfg.cp_size,
    )
    cp_rank = meshes.cp.get_local_rank()
    # Held-out loss every validation.every_n_steps (validation.path=null: none); read now, so a bad file fails early.
    validator = Validator(
        cfg.validation,
        lambda path: held_out_batches(path, cfg.dataset, tokenizer, meshes.dp_rank, meshes.dp_size, cfg.cp_size),
        dp_rank=meshes.dp_rank,
        device=device,
        output_dir=cfg.output_dir,
        wandb_mode=cfg.wandb.mode,
        cp_size=cfg.cp_size,
        cp_rank=cp_rank,
    )

    checkpointer = Checkpointer(
        cfg.checkpoint.ckpt_dir,
        "fsdp2",
        async_save=cfg.checkpoint.async_save,
        max_checkpoints=cfg.checkpoint.max_checkpoints,
    )
    if cfg.checkpoint.resume:
        start_step = checkpointer.load_latest(model, optimizer, scheduler, dataloader)
    else:
        start_step = checkpointer.start_afresh()  # refuses an earlier run's checkpoints
    validator.resume_at(start_step)  # the steps after it are validated again
    if dist_config.is_main_process():  # after resuming: a run refused for another model shape leaves it as it was
        built.config.save_pretrained(Path(cfg.checkpoint.ckpt_dir) / "model_config")
    with torch.random.fork_rng(devices=[]):  # making the iterator draws from the RNG; keep resumed runs identical
        batches = iter(dataloader)

    perf = PerfLogger(
        cfg, built.model_flops, pad_token_id(tokenizer), start_step, cp_size=cfg.cp_size, config_name=config_name()
    )
    profiler = Profiler(cfg.profiler, cfg.output_dir)
    built.train_model.train()

    # DelayedScaling: every FP8 scale set on the first batch before step 1, instead of the first steps' gradients being
    # cast with scales of 1 (fp8_calibration.py); the passes' gradients are discarded and the RNG state kept.
    batches = calibrate_on_first_batch(
        cfg.fp8_config.calibrate_delayed_scaling,
        built.plan.fp8_recipe,
        model,
        optimizer,
        batches,
        loss_of=lambda batch: (
            built.train_model(**move_to_device(shard_for_context_parallel(batch, cp_rank, cfg.cp_size), device)).loss
        ),
        grad_acc_steps=cfg.grad_acc_steps,
    )

    step = start_step
    for step in range(start_step + 1, cfg.num_train_steps + 1):
        with profiler.step_context(step):
            step_loss = torch.zeros((), device=device)
            # Weights come from the full batches, so every rank of a CP group uses the same ones.
            micro_batches = [next(batches) for _ in range(cfg.grad_acc_steps)]
            weights = step_token_weights(
                [count_targets(batch, causal_lm=True) for batch in micro_batches], device, meshes.dp.get_group()
            )
            for micro_step, full_batch in enumerate(micro_batches):
                batch = move_to_device(shard_for_context_parallel(full_batch, cp_rank, cfg.cp_size), device)
                perf.count_batch(batch)
                # The model reduces the loss over the CP group: its value is the group's mean, its gradient scaled
                # by cp_size so that FSDP's average over dp x cp ranks gives the average over dp of those means.
                with built.gradient_sync(micro_step == cfg.grad_acc_steps - 1):
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
        checkpointer.poll()
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            checkpointer.save(step, model, optimizer, scheduler, dataloader)

    if cfg.checkpoint.save_final and step > start_step:
        checkpointer.save(step, model, optimizer, scheduler, dataloader)
    perf.finish()

    if cfg.export_final_model:
        full_state_dict = gather_full_state_dict(model, "fsdp2")
        export_final_model(model, full_state_dict, Path(cfg.output_dir) / "final_model", tokenizer)
    checkpointer.close()
    cleanup_distributed()


if __name__ == "__main__":
    main()
