"""One optimizer step on zero gradients, of the model and optimizer a strategy builds: what weight decay alone does.

    python tests/zero_gradient_step.py ddp OUT.pt [hydra overrides]
    torchrun --nproc_per_node=2 tests/zero_gradient_step.py fsdp2 OUT.pt [...]
    torchrun --nproc_per_node=1 tests/zero_gradient_step.py mfsdp OUT.pt ++model_config_overrides.backend=te  # GPU

The L0 model is built by ``model_setup.build_model`` (DDP: whole; FSDP2: sharded over the processes; Megatron-FSDP:
sharded together with its optimizer, whose parameter groups model_setup restores), its optimizer as train_ddp.py and
train_fsdp2.py build theirs. The loss is multiplied by 0, so every gradient is 0 and AdamW's update is 0: only weight
decay, ``lr * weight_decay`` of each decayed weight, moves anything. Rank 0 saves the full weights before and after the
step, and the optimizer's groups (by parameter name), to OUT.pt for tests/test_weight_decay.py to check.
"""

import sys
from pathlib import Path

import torch


RECIPE_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECIPE_DIR))

from adamw import build_adamw  # noqa: E402
from checkpoint import gather_full_state_dict  # noqa: E402
from distributed import Meshes, build_meshes, cleanup_distributed, setup_distributed  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from model_setup import build_model, mfsdp_mesh, model_image_size  # noqa: E402
from weight_decay import weight_decay_groups  # noqa: E402


def main(strategy: str, out: str, *overrides: str) -> None:
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        cfg = compose(config_name="L0_sanity", overrides=list(overrides))
    dist_config, device = setup_distributed(require_process_group=strategy != "ddp")
    torch.manual_seed(cfg.seed)
    meshes = None
    if strategy == "fsdp2":
        meshes = build_meshes(dist_config, device)
    elif strategy == "mfsdp":
        mesh = mfsdp_mesh(cfg, dist_config.world_size)
        meshes = Meshes(fsdp=mesh, dp=mesh["dp"])
    built = build_model(cfg, device, meshes, strategy, class_names=["a", "b", "c", "d"])
    optimizer = built.optimizer or build_adamw(
        weight_decay_groups(built.model, cfg.adamw_kwargs.weight_decay), cfg, device
    )
    names = {id(param): name.removeprefix("module.") for name, param in built.model.named_parameters()}
    groups = [
        {"weight_decay": group["weight_decay"], "lr": group["lr"], "names": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]

    # (a copy: DDP's full state dict on the CPU is the live parameters themselves)
    before = {key: value.clone() for key, value in gather_full_state_dict(built.model, strategy).items()}
    size = model_image_size(cfg)
    pixels = torch.randn(2, 3, size, size, device=device)
    labels = torch.zeros(2, dtype=torch.long, device=device)
    loss = built.train_model(pixel_values=pixels, labels=labels).loss * 0.0
    loss.backward()
    optimizer.step()
    after = gather_full_state_dict(built.model, strategy)
    if dist_config.rank == 0:
        torch.save({"before": before, "after": after, "groups": groups}, out)
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
