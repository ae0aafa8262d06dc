"""Pre-train Llama 3 on DNA with DistributedDataParallel: every GPU holds the whole model and averages gradients.

    python train_ddp.py                                   # one process (CPU or one GPU), the L0 sanity config
    torchrun --nproc_per_node=8 train_ddp.py --config-name L1_1B_perf dataset.path=/data/genome.fasta

Reads top to bottom: set up processes, build the model, wrap it, build optimizer/scheduler/data, resume, train,
export. Every key it reads is documented in hydra_config/defaults.yaml.
"""

import logging
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from checkpoint import Checkpointer, export_final_model, gather_full_state_dict
from collator import token_weights
from dataset import create_dataloader
from distributed import cleanup_distributed, move_to_device, setup_distributed
from model_setup import config_name, load_model_config, pad_token_id, recipe_path
from modeling_llama_te import NVLlamaForCausalLM
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops, PerfLogger, Profiler
from scheduler import get_linear_schedule_with_warmup
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoTokenizer


logger = logging.getLogger(__name__)


@hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3")
def main(cfg: DictConfig) -> None:
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a missing `???` value fails here, by name
    dist_config, device = setup_distributed()
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    torch.manual_seed(cfg.seed)

    # Model: the same random init on every rank (same seed); DDP also broadcasts rank 0's weights.
    tokenizer = AutoTokenizer.from_pretrained(recipe_path(cfg.tokenizer_path))
    config, plan = load_model_config(cfg)
    model = NVLlamaForCausalLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe).to(device)
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    logger.info("Model: %s backend, %.1fM parameters", model.backend, sum(p.numel() for p in model.parameters()) / 1e6)

    # The model's buffers (rotary frequencies) never change: no per-step broadcast.
    ddp = None
    if dist_config.launched_by_torchrun:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
    ddp_model = ddp or model
    if cfg.use_torch_compile:
        ddp_model = torch.compile(ddp_model)
    use_bf16 = cfg.mixed_precision.enabled and (device.type == "cuda" or cfg.mixed_precision.on_cpu)

    # Optimizer, schedule, data.
    optimizer = torch.optim.AdamW(model.parameters(), **cfg.adamw_kwargs, fused=device.type == "cuda")
    scheduler = get_linear_schedule_with_warmup(optimizer, **cfg.lr_scheduler_kwargs)
    dataloader = create_dataloader(
        cfg.dataset, tokenizer, dp_rank=dist_config.rank, dp_world_size=dist_config.world_size, seed=cfg.seed
    )

    # Resume from the newest complete checkpoint (model, optimizer, schedule, data position, RNG).
    checkpointer = Checkpointer(cfg.checkpoint.ckpt_dir, "ddp", max_checkpoints=cfg.checkpoint.max_checkpoints)
    start_step = 0
    if cfg.checkpoint.resume:
        start_step = checkpointer.load_latest(model, optimizer, scheduler, dataloader, map_location=device)
    with torch.random.fork_rng(devices=[]):  # making the iterator draws from the RNG; keep resumed runs identical
        batches = iter(dataloader)

    perf = PerfLogger(cfg, model_flops, pad_token_id(tokenizer), start_step, config_name=config_name())
    profiler = Profiler(cfg.profiler, cfg.output_dir)
    ddp_model.train()
    step = start_step
    for step in range(start_step + 1, cfg.num_train_steps + 1):
        with profiler.step_context(step):
            step_loss = torch.zeros((), device=device)
            # Weight each micro-batch by its share of the step's scored tokens: k micro-batches then give the
            # gradient of one batch holding all of them, however the degenerate-base masking falls.
            micro_batches = [next(batches) for _ in range(cfg.grad_acc_steps)]
            weights = token_weights(micro_batches)
            for micro_step, batch in enumerate(micro_batches):
                batch = move_to_device(batch, device)
                perf.count_batch(batch)
                # Gradients are all-reduced only on the last micro-batch; earlier ones accumulate locally.
                last = micro_step == cfg.grad_acc_steps - 1
                sync = nullcontext() if last or ddp is None else ddp.no_sync()
                with sync:
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                        loss = ddp_model(**batch).loss * weights[micro_step]
                    loss.backward()
                step_loss += loss.detach()

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        perf.log_step(step, step_loss, grad_norm, lr)
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            checkpointer.save(step, model, optimizer, scheduler, dataloader)

    if cfg.checkpoint.save_final and step > start_step:
        checkpointer.save(step, model, optimizer, scheduler, dataloader)
    perf.finish()

    # Export a Hugging Face directory that loads anywhere, without this recipe's low-precision settings.
    if cfg.export_final_model:
        full_state_dict = gather_full_state_dict(model, "ddp")
        export_final_model(model, full_state_dict, Path(cfg.output_dir) / "final_model", tokenizer)
    checkpointer.close()
    cleanup_distributed()


if __name__ == "__main__":
    main()
