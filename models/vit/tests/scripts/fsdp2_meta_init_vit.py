"""torchrun worker: build the ViT on the meta device, shard every transformer layer and the whole model with FSDP2,
init_empty_weights(), then check the gathered full weights against a one-process init from the same seed (bit for
bit), that no two ranks hold the same shard, and that a training step runs. Prints SHARDED-INIT-OK on rank 0.

Argument: ``torch`` (torch backend, CPU processes on gloo, the default) or ``te`` (TE, one GPU per rank on NCCL).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


# The package and tests/, whether or not the package is pip-installed (a GPU machine may run from a checkout).
COMPONENT_DIR = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(COMPONENT_DIR), str(COMPONENT_DIR / "tests")]
from vit_testing import images, init_config  # noqa: E402

from vit_te.modeling_vit_te import NVViTForImageClassification  # noqa: E402


SEED = 0


def gather_full_weights(model) -> dict[str, torch.Tensor]:
    full = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), (name, type(param))
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, param.to_local().detach().cpu())
        full[name] = torch.cat(shards)
    return full


def main(mode: str) -> None:
    dist.init_process_group(backend="nccl" if mode == "te" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if mode == "te" else torch.device("cpu")
    if mode == "te":
        torch.cuda.set_device(device)
    config = init_config(backend="te" if mode == "te" else "torch")

    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = NVViTForImageClassification(config)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.vit.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.init_empty_weights(device)
    sharded = gather_full_weights(model)

    torch.manual_seed(SEED)
    with torch.device("meta"):
        reference = NVViTForImageClassification(config)
    reference.init_empty_weights(device)
    expected = {name: param.detach().cpu() for name, param in reference.named_parameters()}
    assert sharded.keys() == expected.keys(), sorted(sharded.keys() ^ expected.keys())
    for name, full in sharded.items():
        assert torch.equal(full, expected[name]), f"{name}: differs from the one-process init"
        if full.dim() > 1 and full.shape[0] >= world:
            shards = full.chunk(world)
            for i in range(len(shards)):
                for j in range(i + 1, len(shards)):
                    if shards[i].shape == shards[j].shape:
                        assert not torch.equal(shards[i], shards[j]), f"{name}: ranks {i} and {j} hold equal shards"

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pixels = images(4, size=config.image_size, seed=rank).to(device)
    loss = model(pixels, labels=torch.arange(4, device=device) % config.num_labels).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    if rank == 0:
        print("SHARDED-INIT-OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "torch")
