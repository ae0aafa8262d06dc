"""Pre-train ESM-2 or AMPLIFY (``model_tag``) with Megatron-FSDP (``megatron_fsdp.fully_shard``): NVIDIA's FSDP with
bucketed, overlapped communication and fp32 main weights kept in its own sharded buffers (or bf16 weights alone:
``mixed_precision.fp32_master_weights=false``). NVIDIA GPUs only.

    torchrun --nproc_per_node=8 train_mfsdp.py --config-name L1_3B

Reads top to bottom: mesh, model and optimizer sharded together (``model_setup.build_model``), scheduler/data, resume,
train, export. Every
key it reads is documented in hydra_config/defaults.yaml.
"""

import logging
from pathlib import Path

import hydra
import torch
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from dataset import create_dataloader
from distributed import Meshes, cleanup_distributed, move_to_device, setup_distributed
from fp8_calibration import calibrate_on_first_batch
from grad_accumulation import count_targets, step_token_weights
from grad_clipping import clip_grad_norm_and_step
from model_families import load_tokenizer
from model_setup import build_model
from omegaconf import DictConfig, OmegaConf
from packing import with_labeled_token_index
from perf_logger import PerfLogger, Profiler, quiet_progress_bars_off_a_terminal
from quant_stats import QuantStats
from recipe_paths import config_name
from scheduler import get_linear_schedule_with_warmup
from torch.distributed.device_mesh import init_device_mesh
from user_errors import MissingPackageError, UnsupportedHardwareError, check_config, report_user_errors
from validation import Validator
from validation_data import held_out_batches


logger = logging.getLogger(__name__)


def import_megatron_fsdp():
    """Megatron-FSDP needs NVIDIA GPUs; say so plainly instead of failing deep inside it (model_setup.py uses it)."""
    if not torch.cuda.is_available():
        raise UnsupportedHardwareError(
            "train_mfsdp.py needs CUDA GPUs (Megatron-FSDP is GPU-only); use train_fsdp2.py on a CPU"
        )
    try:
        import megatron_fsdp
    except ImportError as error:
        raise MissingPackageError(
            "train_mfsdp.py needs the megatron-fsdp package: pip install megatron-fsdp"
        ) from error
    return megatron_fsdp


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)  # a `???` value left unset or a mistyped override (num_train_steps=abc) fails here, by name
    quiet_progress_bars_off_a_terminal()  # in a log file a bar is one endless line
    import_megatron_fsdp()
    dist_config, device = setup_distributed(require_process_group=True)
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    torch.manual_seed(cfg.seed)
    # Megatron-FSDP wants a tensor-parallel dimension too (TE layers assume one); it is trivial here.
    mesh = init_device_mesh("cuda", (dist_config.world_size, 1), mesh_dim_names=("dp", "tp"))

    # Model built whole on this GPU (pretrained weights with init_from_pretrained), then sharded together with its
    # optimizer; each transformer layer is one FSDP unit.
    tokenizer = load_tokenizer(cfg)  # the model family's, with tokenizer_path: auto
    quant_stats = QuantStats.start(cfg.quant_stats, cfg.output_dir)  # before TE builds its first layer
    built = build_model(cfg, device, Meshes(fsdp=mesh, dp=mesh["dp"]), strategy="mfsdp", quant_stats=quant_stats)
    model, optimizer = built.model, built.optimizer

    # Scheduler after sharding: fully_shard rebuilds the optimizer's parameter groups.
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    dataloader = create_dataloader(
        cfg.dataset, tokenizer, dp_rank=dist_config.rank, dp_world_size=dist_config.world_size, seed=cfg.seed
    )
    # Held-out loss every validation.every_n_steps (validation.path=null: none); read now, so a bad file fails early.
    validator = Validator(
        cfg.validation,
        lambda path: held_out_batches(
            path,
            cfg.dataset,
            tokenizer,
            dist_config.rank,
            dist_config.world_size,
            cfg.seed,
            split=cfg.validation.split,
        ),
        dp_rank=dist_config.rank,
        device=device,
        output_dir=cfg.output_dir,
        wandb_mode=cfg.wandb.mode,
        forward_kwargs={"labeled_logits_only": True},  # the MLM head on the masked tokens only, as in training
    )

    checkpointer = Checkpointer(
        cfg.checkpoint.ckpt_dir,
        "mfsdp",
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

    perf = PerfLogger(cfg, built.model_flops, tokenizer.pad_token_id, start_step, config_name=config_name())
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
            built.train_model(**move_to_device(with_labeled_token_index(batch), device), labeled_logits_only=True).loss
        ),
        grad_acc_steps=cfg.grad_acc_steps,
    )

    step = start_step
    for step in range(start_step + 1, cfg.num_train_steps + 1):
        with profiler.step_context(step):
            step_loss = torch.zeros((), device=device)
            # Weight each micro-batch by its share of the step's masked tokens on all DP ranks (as one batch holding
            # them all).
            micro_batches = [next(batches) for _ in range(cfg.grad_acc_steps)]
            weights = step_token_weights([count_targets(batch, causal_lm=False) for batch in micro_batches], device)
            for micro_step, batch in enumerate(micro_batches):
                # The model runs its MLM head on the masked tokens only; they are found here, on the CPU (on the GPU
                # that would cost a host sync per micro-batch).
                batch = move_to_device(with_labeled_token_index(batch), device)
                perf.count_batch(batch)
                # Reduce gradients only after the last micro-batch.
                with built.gradient_sync(micro_step == cfg.grad_acc_steps - 1):
                    loss = built.train_model(**batch, labeled_logits_only=True).loss * weights[micro_step]
                    loss.backward()
                step_loss += loss.detach()

            lr = scheduler.get_last_lr()[0]
            # sharded: not torch's clip_grad_norm_, as a rank holding no piece of a parameter has no .grad there; with
            # bf16 weights the optimizer applies the clip factor as it reads the gradients (grad_clipping.py)
            grad_norm = clip_grad_norm_and_step(optimizer, model.parameters(), cfg.max_grad_norm, sharded=True)
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
        full_state_dict = gather_full_state_dict(model, "mfsdp")
        export_final_model(model.module, full_state_dict, Path(cfg.output_dir) / "final_model", tokenizer)
    checkpointer.close()
    quant_stats.close()
    cleanup_distributed()


if __name__ == "__main__":
    main()
