"""torchrun worker (2 GPUs, TE, NCCL): split the ViT's layers over the ranks with ``tp_group`` and load each rank's
share of a whole model (``tensor_parallel_shard``); the split model's logits, loss and gradients must be the whole
model's. Also: the split parameters are the ones TE marks, and the shares of one weight matrix differ between ranks.
Prints TENSOR-PARALLEL-OK on rank 0.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


# The package and tests/, whether or not the package is pip-installed (a GPU machine may run from a checkout).
COMPONENT_DIR = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(COMPONENT_DIR), str(COMPONENT_DIR / "tests")]
from vit_testing import images  # noqa: E402

from vit_te.modeling_vit_te import NVViTConfig, NVViTForImageClassification, tensor_parallel_shard  # noqa: E402


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def main() -> None:
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    config = NVViTConfig(
        hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=1024, image_size=64,
        patch_size=8, num_labels=10, backend="te",
    )  # fmt: skip
    torch.manual_seed(0)
    whole = NVViTForImageClassification(config).cuda()
    split = NVViTForImageClassification(config, tp_group=dist.group.WORLD).cuda()
    split.load_state_dict(tensor_parallel_shard(split, whole.state_dict(), rank, world), strict=False)

    marked = sorted(n for n, p in split.named_parameters() if getattr(p, "tensor_model_parallel", False))
    layer0 = [n for n in marked if n.startswith("vit.encoder.layers.0.")]
    assert layer0 == [
        f"vit.encoder.layers.0.{n}"
        for n in (
            "layernorm_mlp.fc1_bias", "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight",
            "self_attention.layernorm_qkv.bias", "self_attention.layernorm_qkv.weight", "self_attention.proj.weight",
        )
    ], layer0  # fmt: skip
    for name in (n for n in marked if n.endswith("weight")):  # a different share of every split weight (biases: 0)
        shares = [None] * world
        dist.all_gather_object(shares, split.get_parameter(name).detach().cpu())
        assert not torch.equal(shares[0], shares[1]), name

    pixels = images(8, size=64).cuda()  # the same images on both ranks: they split the layers, not the batch
    labels = (torch.arange(8) % 10).cuda()
    results = {}
    for label, model in (("whole", whole), ("split", split)):
        model.to(torch.bfloat16)
        out = model(pixels.bfloat16(), labels=labels)
        out.loss.backward()
        results[label] = out
    assert relative_error(results["split"].logits, results["whole"].logits) < 2e-2
    assert abs(results["split"].loss.item() - results["whole"].loss.item()) < 1e-2 * results["whole"].loss.item()
    # Gradients: replicated parameters alike on both ranks; split ones equal to this rank's share of the whole's.
    whole_grads = {n: p.grad for n, p in whole.named_parameters()}
    grad_shares = tensor_parallel_shard(split, whole_grads, rank, world)
    for name, param in split.named_parameters():
        assert relative_error(param.grad, grad_shares[name]) < 5e-2, name
    if rank == 0:
        print(f"TENSOR-PARALLEL-OK: {len(marked)} split parameters, logits within 2%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
