"""Train a ViT image classifier with Megatron-FSDP (``megatron_fsdp.fully_shard``): NVIDIA's FSDP with bucketed,
overlapped communication and fp32 main weights in its own sharded buffers (or bf16 weights alone:
``mixed_precision.fp32_master_weights=false``), over a mesh of replicas (HSDP), shards and tensor-parallel ranks.
NVIDIA GPUs only.

    torchrun --nproc_per_node=8 train_mfsdp.py --config-name vit_base dataset.path=/data/imagenet
    torchrun --nproc_per_node=8 train_mfsdp.py --config-name vit_base mfsdp.tp=2 ...  # layers split over 2 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 ... train_mfsdp.py --config-name vit_base mfsdp.dp_replicate=2 ...  # HSDP

Reads top to bottom: data (its classes size the classifier), mesh, model and optimizer sharded together
(``model_setup.build_model``), scheduler, resume, train with validation, export. Every key it reads is documented in
hydra_config/defaults.yaml.
"""

import logging
from pathlib import Path

import hydra
import torch
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from dataset import create_dataloaders
from distributed import Meshes, cleanup_distributed, move_to_device, setup_distributed
from evaluation import BestModel, ValidationLog, evaluate
from fp8_calibration import calibrate_on_first_batch
from grad_clipping import clip_grad_norm_and_step
from image_throughput import add_images_per_second, token_grid
from model_setup import build_model, image_processor, mfsdp_mesh, model_image_size
from omegaconf import DictConfig, OmegaConf
from perf_logger import PerfLogger, Profiler, quiet_progress_bars_off_a_terminal
from recipe_paths import config_name
from scheduler import get_linear_schedule_with_warmup
from user_errors import MissingPackageError, UnsupportedHardwareError, check_config, report_user_errors


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
    # Replicas x shards x tensor-parallel ranks (mfsdp.*); a GPU's data share is its place among replicas x shards.
    mesh = mfsdp_mesh(cfg, dist_config.world_size)
    meshes = Meshes(fsdp=mesh, dp=mesh["dp"])

    # Data first: its classes decide the classifier's size. Each data-parallel rank reads its own share.
    train_loader, val_loader, class_names = create_dataloaders(
        cfg.dataset, model_image_size(cfg), dp_rank=meshes.dp_rank, dp_world_size=meshes.dp_size, seed=cfg.seed
    )

    # Model built whole on this GPU (pretrained weights with init_from_pretrained), then sharded together with its
    # optimizer; each transformer layer is one FSDP unit. Scheduler after sharding: it rebuilds the parameter groups.
    built = build_model(cfg, device, meshes, strategy="mfsdp", class_names=class_names)
    model, optimizer = built.model, built.optimizer
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)

    # Resume from the newest complete checkpoint (sharded model/optimizer, schedule, data position, RNG).
    checkpointer = Checkpointer(
        cfg.checkpoint.ckpt_dir,
        "mfsdp",
        async_save=cfg.checkpoint.async_save,
        max_checkpoints=cfg.checkpoint.max_checkpoints,
    )
    if cfg.checkpoint.resume:
        start_step = checkpointer.load_latest(model, optimizer, scheduler, train_loader)
    else:
        start_step = checkpointer.start_afresh()  # refuses an earlier run's checkpoints
    with torch.random.fork_rng(devices=[]):  # making the iterator draws from the RNG; keep resumed runs identical
        batches = iter(train_loader)

    processor = image_processor(cfg, built.config)
    best = BestModel(Path(cfg.output_dir) / "best_model", "mfsdp", processor)
    validation_log = ValidationLog(cfg.output_dir, start_step)
    perf = PerfLogger(cfg, built.model_flops, pad_token_id=-1, start_step=start_step, config_name=config_name())
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
        loss_of=lambda batch: built.train_model(**move_to_device(batch, device)).loss,
        grad_acc_steps=cfg.grad_acc_steps,
    )

    step = start_step
    for step in range(start_step + 1, cfg.num_train_steps + 1):
        with profiler.step_context(step):
            step_loss = torch.zeros((), device=device)
            # Weight each micro-batch by its share of the step's images (an epoch's last batch may be smaller).
            micro_batches = [next(batches) for _ in range(cfg.grad_acc_steps)]
            images = [len(batch["labels"]) for batch in micro_batches]
            for micro_step, batch in enumerate(micro_batches):
                batch = move_to_device(batch, device)
                # Tensor-parallel ranks compute on the same images: one of them counts them for tokens/s and MFU.
                counted = images[micro_step] if built.tensor_parallel_rank == 0 else 0
                perf.count_batch(token_grid(counted, built.tokens_per_image, device))
                # Reduce gradients only after the last micro-batch.
                with built.gradient_sync(micro_step == cfg.grad_acc_steps - 1):
                    loss = built.train_model(**batch).loss * (images[micro_step] / sum(images))
                    loss.backward()
                step_loss += loss.detach()

            lr = scheduler.get_last_lr()[0]
            # sharded: not torch's clip_grad_norm_, as a rank holding no piece of a parameter has no .grad there; with
            # bf16 weights the optimizer applies the clip factor as it reads the gradients (grad_clipping.py)
            grad_norm = clip_grad_norm_and_step(optimizer, model.parameters(), cfg.max_grad_norm, sharded=True)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        perf.log_step(step, step_loss, grad_norm, lr)
        if val_loader is not None and cfg.validation.every_n_steps and step % cfg.validation.every_n_steps == 0:
            metrics = evaluate(built.train_model, val_loader, device, group=meshes.dp.get_group())
            validation_log.write(step, metrics)
            best.update(step, metrics, model)
        checkpointer.poll()  # finalise a finished background save without waiting for one
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            checkpointer.save(step, model, optimizer, scheduler, train_loader)

    if cfg.checkpoint.save_final and step > start_step:
        checkpointer.save(step, model, optimizer, scheduler, train_loader)
    add_images_per_second(perf.finish(), cfg.output_dir, built.tokens_per_image)

    # Export a Hugging Face directory: gather the full weights (collective), written by rank 0.
    if cfg.export_final_model:
        full_state_dict = gather_full_state_dict(model, "mfsdp")
        export_final_model(model.module, full_state_dict, Path(cfg.output_dir) / "final_model", processor)
    checkpointer.close()  # an asynchronous save must land before the process exits
    cleanup_distributed()


if __name__ == "__main__":
    main()
