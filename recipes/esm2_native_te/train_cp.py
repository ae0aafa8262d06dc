"""Pre-train ESM-2 or AMPLIFY (``model_tag``) with context parallelism: each sequence is split over ``cp_size`` GPUs
(ring attention in TransformerEngine), and FSDP2 shards the weights over all GPUs. For sequences too long for one GPU's
memory.

    torchrun --nproc_per_node=8 train_cp.py --config-name L0_sanity_cp cp_size=2

Needs THD input. On GPUs the TE backend runs ring attention; on CPU processes the torch backend all-gathers Q/K/V
and gives the same numbers (how CI tests this script). Reads top to bottom like train_fsdp2.py; what differs is the
(dp, cp) mesh, the CP group handed to the model (``model_setup.build_model``), and the batches: the loader yields
full batches with every sequence padded for CP (all ranks of a CP group read the same ones), and each rank keeps
its own share of every sequence right before the forward pass.
"""

import logging
from pathlib import Path

import hydra
import torch
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from context_parallel import shard_for_context_parallel
from dataset import create_dataloader
from distributed import build_meshes, cleanup_distributed, move_to_device, setup_distributed
from fp8_calibration import calibrate_on_first_batch
from grad_accumulation import count_targets, step_token_weights
from grad_clipping import clip_grad_norm_and_step
from model_families import load_tokenizer
from model_setup import build_model, build_optimizer
from omegaconf import DictConfig, OmegaConf
from packing import with_labeled_token_index
from perf_logger import PerfLogger, Profiler, quiet_progress_bars_off_a_terminal
from quant_stats import QuantStats
from recipe_paths import config_name
from scheduler import get_linear_schedule_with_warmup
from user_errors import ConfigError, check_config, report_user_errors
from validation import Validator
from validation_data import held_out_batches


logger = logging.getLogger(__name__)


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity_cp", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)  # a `???` value left unset or a mistyped override (num_train_steps=abc) fails here, by name
    if cfg.cp_size > 1 and cfg.dataset.input_format != "thd":
        # The model's CP attention takes packed sequences only: say so now, not in the first forward pass.
        raise ConfigError(f"context parallelism (cp_size={cfg.cp_size}) needs dataset.input_format=thd, not "
                          f"{cfg.dataset.input_format}")  # fmt: skip
    quiet_progress_bars_off_a_terminal()  # in a log file a bar is one endless line
    dist_config, device = setup_distributed(require_process_group=True)
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    torch.manual_seed(cfg.seed)
    meshes = build_meshes(dist_config, device, cp_size=cfg.cp_size)

    # The model as in train_fsdp2.py, sharded over all ranks (dp x cp: CP ranks hold the same weights, so sharding
    # over them too only saves memory), its attention split over this rank's CP group.
    tokenizer = load_tokenizer(cfg)  # the model family's, with tokenizer_path: auto
    quant_stats = QuantStats.start(cfg.quant_stats, cfg.output_dir)  # before TE builds its first layer
    built = build_model(cfg, device, meshes, strategy="fsdp2", quant_stats=quant_stats)
    model = built.model

    optimizer = build_optimizer(cfg, model, device)  # CompensatedAdamW on CUDA (adamw.py)
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    # All CP ranks of a DP group read the same sequences (full batches); each keeps its own share of them below.
    dataloader = create_dataloader(
        cfg.dataset,
        tokenizer,
        dp_rank=meshes.dp_rank,
        dp_world_size=meshes.dp_size,
        seed=cfg.seed,
        cp_size=cfg.cp_size,
    )
    cp_rank = meshes.cp.get_local_rank() if meshes.cp is not None else None  # None: cp_size=1, nothing to split
    # Held-out loss every validation.every_n_steps (validation.path=null: none); read now, so a bad file fails early.
    validator = Validator(
        cfg.validation,
        lambda path: held_out_batches(
            path, cfg.dataset, tokenizer, meshes.dp_rank, meshes.dp_size, cfg.seed, cfg.cp_size, cfg.validation.split
        ),
        dp_rank=meshes.dp_rank,
        device=device,
        output_dir=cfg.output_dir,
        wandb_mode=cfg.wandb.mode,
        cp_size=cfg.cp_size,
        cp_rank=cp_rank or 0,
        forward_kwargs={"labeled_logits_only": True},  # the MLM head on the masked tokens only, as in training
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
    with torch.random.fork_rng(devices=[]):  # making the iterator draws from the RNG; keep resumed runs identical
        batches = iter(dataloader)

    perf = PerfLogger(
        cfg, built.model_flops, tokenizer.pad_token_id, start_step, cp_size=cfg.cp_size, config_name=config_name()
    )
    profiler = Profiler(cfg.profiler, cfg.output_dir)
    built.train_model.train()

    def first_batch_loss(batch):  # as the loop computes a micro-batch's loss
        batch = batch if cp_rank is None else shard_for_context_parallel(batch, cp_rank, cfg.cp_size)
        return built.train_model(
            **move_to_device(with_labeled_token_index(batch), device), labeled_logits_only=True
        ).loss

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
            # Weights come from the full batches (masked tokens before the CP split), so every rank of a CP group
            # uses the same ones.
            micro_batches = [next(batches) for _ in range(cfg.grad_acc_steps)]
            weights = step_token_weights(
                [count_targets(batch, causal_lm=False) for batch in micro_batches], device, meshes.dp.get_group()
            )
            for micro_step, full_batch in enumerate(micro_batches):
                batch = full_batch if cp_rank is None else shard_for_context_parallel(full_batch, cp_rank, cfg.cp_size)
                # The model runs its MLM head on the masked tokens only; they are found here, on the CPU (on the GPU
                # that would cost a host sync per micro-batch).
                batch = move_to_device(with_labeled_token_index(batch), device)
                perf.count_batch(batch)
                # A CP shard may hold few or no labels, so the model reduces the loss over the CP group: its value is
                # the group's mean, its gradient scaled by cp_size to survive FSDP's average over dp x cp ranks.
                with built.gradient_sync(micro_step == cfg.grad_acc_steps - 1):
                    loss = built.train_model(**batch, labeled_logits_only=True).loss * weights[micro_step]
                    loss.backward()
                step_loss += loss.detach()

            lr = scheduler.get_last_lr()[0]
            # Clips and steps; with bf16 weights the optimizer applies the clip factor as it reads the gradients.
            grad_norm = clip_grad_norm_and_step(optimizer, model.parameters(), cfg.max_grad_norm)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            quant_stats.step()

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
    quant_stats.close()
    cleanup_distributed()


if __name__ == "__main__":
    main()
