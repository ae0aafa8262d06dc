"""Time the training step of a config without the data pipeline: random images already on the device, so the number
is the model's (forward, backward, gradient clipping, optimizer step) and not the image decoding's.

Compare it with the images/s of a real run (summary.json): if the run is much slower, the data loader is the
bottleneck (more `dataset.num_workers`, faster storage, or smaller images on disk), not the GPU.

    python scripts/step_benchmark.py --config vit_base --strategy mfsdp --micro-batch 256
    python scripts/step_benchmark.py --config vit_base --strategy mfsdp --micro-batch 256 fp8_config.enabled=true
    python scripts/step_benchmark.py --config L0_sanity --strategy ddp --steps 5 +model_config_overrides.backend=torch

Extra arguments are Hydra overrides of the config. One process (one GPU, or the CPU with ``--strategy ddp``); prints
one JSON line: images/s, tokens/s, step time, MFU (against ``logger.peak_flops_per_gpu``), peak memory.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch


RECIPE_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECIPE_DIR))

from adamw import build_adamw  # noqa: E402
from distributed import Meshes, cleanup_distributed, setup_distributed  # noqa: E402
from grad_clipping import clip_grad_norm_and_step  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from mixed_precision import computes_in_bf16  # noqa: E402
from model_setup import build_model, mfsdp_mesh, model_image_size  # noqa: E402
from weight_decay import weight_decay_groups  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="vit_base", help="Hydra config name (hydra_config/<name>.yaml)")
    parser.add_argument("--strategy", choices=("mfsdp", "ddp"), default="mfsdp", help="mfsdp needs a GPU")
    parser.add_argument("--micro-batch", type=int, default=None, help="images per step (default: the config's)")
    parser.add_argument("--classes", type=int, default=1000, help="classifier outputs (default: ImageNet's 1000)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. fp8_config.enabled=true")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        cfg = compose(config_name=args.config, overrides=args.overrides)
    dist_config, device = setup_distributed(require_process_group=args.strategy == "mfsdp")
    if dist_config.world_size != 1:
        raise SystemExit("step_benchmark.py times one process; launch it without torchrun or with one process")
    if args.strategy == "mfsdp" and device.type != "cuda":
        raise SystemExit("--strategy mfsdp needs a CUDA GPU; use --strategy ddp on a CPU")
    torch.manual_seed(cfg.seed)
    meshes = None
    if args.strategy == "mfsdp":
        mesh = mfsdp_mesh(cfg, 1)
        meshes = Meshes(fsdp=mesh, dp=mesh["dp"])
    classes = [f"class_{i}" for i in range(args.classes)]
    built = build_model(cfg, device, meshes, strategy=args.strategy, class_names=classes)
    if built.optimizer is not None:
        optimizer = built.optimizer
    else:
        # as train_ddp.py builds it
        optimizer = build_adamw(weight_decay_groups(built.model, cfg.adamw_kwargs.weight_decay), cfg, device)
    autocast = args.strategy == "ddp" and computes_in_bf16(cfg.mixed_precision, device)  # as train_ddp.py does

    batch_size = args.micro_batch or cfg.dataset.micro_batch_size
    size = model_image_size(cfg)
    generator = torch.Generator(device=device).manual_seed(0)
    pixels = torch.randn(batch_size, 3, size, size, device=device, generator=generator)
    labels = torch.randint(0, args.classes, (batch_size,), device=device, generator=generator)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = built.train_model(pixel_values=pixels, labels=labels).loss
        loss.backward()
        clip_grad_norm_and_step(optimizer, built.model.parameters(), cfg.max_grad_norm, sharded=True)
        optimizer.zero_grad(set_to_none=True)

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize()
    step_time = (time.perf_counter() - start) / args.steps

    tokens = batch_size * built.tokens_per_image
    flops = built.model_flops.flops(tokens, batch_size * built.tokens_per_image**2)
    result = {
        "config": args.config,
        "strategy": args.strategy,
        "overrides": args.overrides,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "micro_batch_images": batch_size,
        "tokens_per_image": built.tokens_per_image,
        "step_time_s": step_time,
        "images_per_second": batch_size / step_time,
        "tokens_per_second": tokens / step_time,
        "mfu": flops / step_time / float(cfg.logger.peak_flops_per_gpu),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }
    print(json.dumps(result))
    cleanup_distributed()
    return result


if __name__ == "__main__":
    main()
