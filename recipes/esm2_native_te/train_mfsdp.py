"""Pre-train ESM-2 with Megatron-FSDP (``megatron_fsdp.fully_shard``): NVIDIA's FSDP with bucketed, overlapped
communication and fp32 main weights kept in its own sharded buffers. NVIDIA GPUs only.

    torchrun --nproc_per_node=8 train_mfsdp.py --config-name L1_3B

Reads top to bottom: mesh, model, shard model and optimizer together, scheduler/data, resume, train, export. Every
key it reads is documented in hydra_config/defaults.yaml.
"""

import logging
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from dataset import create_dataloader
from distributed import cleanup_distributed, move_to_device, setup_distributed
from model_setup import (
    apply_pretrained_weights,
    config_name,
    load_model_config,
    load_pretrained_state_dict,
    recipe_path,
)
from modeling_esm_te import NVEsmForMaskedLM
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops, PerfLogger, Profiler
from quant_stats import QuantStats
from scheduler import get_linear_schedule_with_warmup
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoTokenizer


logger = logging.getLogger(__name__)


def import_megatron_fsdp():
    """Megatron-FSDP needs NVIDIA GPUs; say so plainly instead of failing deep inside it."""
    if not torch.cuda.is_available():
        raise SystemExit("train_mfsdp.py needs CUDA GPUs (Megatron-FSDP is GPU-only); use train_fsdp2.py on a CPU")
    try:
        import megatron_fsdp
    except ImportError as error:
        raise SystemExit("train_mfsdp.py needs the megatron-fsdp package: pip install megatron-fsdp") from error
    return megatron_fsdp


@hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3")
def main(cfg: DictConfig) -> None:
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a missing `???` value fails here, by name
    megatron_fsdp = import_megatron_fsdp()
    dist_config, device = setup_distributed(require_process_group=True)
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    torch.manual_seed(cfg.seed)
    # Megatron-FSDP wants a tensor-parallel dimension too (TE layers assume one); it is trivial here.
    mesh = init_device_mesh("cuda", (dist_config.world_size, 1), mesh_dim_names=("dp", "tp"))

    # Model: built whole on this GPU, then sharded. (Megatron-FSDP's meta-device path would initialise weights with
    # each module's reset_parameters(), not ESM's initialisation, so it is not used.)
    tokenizer = AutoTokenizer.from_pretrained(recipe_path(cfg.tokenizer_path))
    config, plan = load_model_config(cfg)
    quant_stats = QuantStats.start(cfg.quant_stats, cfg.output_dir)  # before TE builds its first layer
    use_bf16 = cfg.mixed_precision.enabled
    with torch.device(device):
        model = NVEsmForMaskedLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    apply_pretrained_weights(model, load_pretrained_state_dict(cfg))  # fine-tuning: init_from_pretrained=true
    if use_bf16:
        model.to(torch.bfloat16)  # compute weights; fp32 main weights live in Megatron-FSDP's buffers
    quant_stats.watch(model)
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    logger.info("Model: %s backend, %.1fM parameters", model.backend, sum(p.numel() for p in model.parameters()) / 1e6)

    # Shard model and optimizer together; each transformer layer is one FSDP unit.
    optimizer = torch.optim.AdamW(model.parameters(), **cfg.adamw_kwargs, fused=True)
    mixed_precision_policy = megatron_fsdp.MixedPrecisionPolicy(
        main_params_dtype=torch.float32 if cfg.mixed_precision.fp32_master_weights else None,
        main_grads_dtype=torch.float32,
    )
    model, optimizer = megatron_fsdp.fully_shard(
        model,
        optimizer,
        device_mesh=mesh,
        dp_shard_dim="dp",
        tp_dim="tp",
        fsdp_unit_modules=[type(model.esm.encoder.layers[0])],
        zero_dp_strategy=cfg.fsdp.mfsdp_zero_dp_strategy,
        mixed_precision_policy=mixed_precision_policy,
        device=device,
    )
    train_model = torch.compile(model) if cfg.use_torch_compile else model

    # Scheduler after sharding: fully_shard rebuilds the optimizer's parameter groups.
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    dataloader = create_dataloader(
        cfg.dataset, tokenizer, dp_rank=dist_config.rank, dp_world_size=dist_config.world_size, seed=cfg.seed
    )

    checkpointer = Checkpointer(
        cfg.checkpoint.ckpt_dir,
        "mfsdp",
        async_save=cfg.checkpoint.async_save,
        max_checkpoints=cfg.checkpoint.max_checkpoints,
    )
    start_step = 0
    if cfg.checkpoint.resume:
        start_step = checkpointer.load_latest(model, optimizer, scheduler, dataloader)
    with torch.random.fork_rng(devices=[]):  # making the iterator draws from the RNG; keep resumed runs identical
        batches = iter(dataloader)

    perf = PerfLogger(cfg, model_flops, tokenizer.pad_token_id, start_step, config_name=config_name())
    profiler = Profiler(cfg.profiler, cfg.output_dir)
    train_model.train()
    step = start_step
    for step in range(start_step + 1, cfg.num_train_steps + 1):
        with profiler.step_context(step):
            step_loss = torch.zeros((), device=device)
            for micro_step in range(cfg.grad_acc_steps):
                batch = move_to_device(next(batches), device)
                perf.count_batch(batch)
                last = micro_step == cfg.grad_acc_steps - 1
                with nullcontext() if last else model.no_sync():  # reduce gradients after the last micro-batch
                    loss = train_model(**batch).loss / cfg.grad_acc_steps
                    loss.backward()
                step_loss += loss.detach()

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            quant_stats.step()

        perf.log_step(step, step_loss, grad_norm, lr)
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
