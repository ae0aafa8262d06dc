"""torchrun worker for test_init.py: build models with model_setup.build_model (what train_fsdp2.py calls, from the
L0_sanity config with a wider 8-layer shape) and report, as JSON from rank 0, what the tests check.

    torchrun --nproc_per_node=N tests/fsdp_worker.py <result.json>

- ``init``: for meta-device and direct construction and each init switch, the std/mean of every gathered full weight
  and whether the two halves of the embedding (one shard per rank with 2 processes) are identical;
- ``seeded``: whether two builds with seed 7 agree and one with seed 8 differs;
- ``validation``: the validation metrics with the file split over the ranks (uneven: ranks run different numbers of
  batches) and with every rank reading all of it.

(What the mixed-precision policy hands the layers is tested in one process by test_model_setup.py.)
"""

import gzip
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dataset import held_out_batches
from distributed import build_meshes, setup_distributed
from hydra import compose, initialize_config_dir
from model_setup import build_model, load_model_config
from modeling_llama_te import NVLlamaConfig
from omegaconf import DictConfig, OmegaConf
from recipe_paths import RECIPE_DIR, recipe_path
from transformers import AutoTokenizer
from validation import Validator


SWITCHES = {"off": (None, False), "spike_no_more": (1.0, False), "scaled_output": (None, True), "both": (1.0, True)}


def _hydra_value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def run_config(embedding_init_std=None, scale_output_projection_init=False, *overrides: str) -> DictConfig:
    """L0_sanity with 8 layers, so depth scaling (0.02 / 4 = 0.005) is far from the plain 0.02, and 65,536-entry
    matrices, so each std is measured to about 0.3%; fp32 on CPU (L0_sanity's default)."""
    model = {"backend": "torch", "num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 512}
    model |= {"embedding_init_std": embedding_init_std, "scale_output_projection_init": scale_output_projection_init}
    model_overrides = [f"++model_config_overrides.{key}={_hydra_value(value)}" for key, value in model.items()]
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        return compose("L0_sanity", ["output_dir=unused", *model_overrides, *overrides])


def config(embedding_init_std=None, scale_output_projection_init=False) -> NVLlamaConfig:
    return load_model_config(run_config(embedding_init_std, scale_output_projection_init))[0]


def full_weights(model) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor().detach().float() for name, param in model.named_parameters()}  # collective


def build(meshes, *run_config_args) -> torch.nn.Module:
    """The sharded, initialised model of ``run_config(*run_config_args)``, as train_fsdp2.py builds it."""
    return build_model(run_config(*run_config_args), torch.device("cpu"), meshes, strategy="fsdp2").model


def init_stats(meshes) -> dict:
    results = {}
    for use_meta in (True, False):
        for switch, (std, scaled) in SWITCHES.items():
            weights = full_weights(build(meshes, std, scaled, f"fsdp.use_meta_device={use_meta}"))
            embedding = weights["model.embed_tokens.weight"]
            results[f"{'meta' if use_meta else 'direct'}/{switch}"] = {
                "std": {name: w.std().item() for name, w in weights.items()},
                "mean": {name: w.mean().item() for name, w in weights.items()},
                "embedding_halves_equal": bool(torch.equal(embedding[:128], embedding[128:])),
            }
    return results


def seeded(meshes) -> dict:
    def weights(seed):
        return full_weights(build(meshes, 1.0, True, f"seed={seed}"))

    first, again, other = weights(7), weights(7), weights(8)
    return {
        "same_seed_equal": all(torch.equal(first[k], again[k]) for k in first),
        "other_seed_differs": any(not torch.equal(first[k], other[k]) for k in first if "norm" not in k),
    }


def validation(meshes, work_dir: Path) -> dict:
    """Three sequences over two ranks: rank 0 reads records 0 and 2 (more batches), rank 1 record 1."""
    path = work_dir / "valid.jsonl.gz"
    if dist.get_rank() == 0:
        with gzip.open(path, "wt") as fh:
            for length in (90, 40, 70):
                fh.write(json.dumps({"text": "ACGTTGCAN" * (length // 9)}) + "\n")
    dist.barrier()
    model = build(meshes)
    data_cfg = {"max_seq_length": 32, "window_overlap": 4, "token_budget": 48}
    val_cfg = OmegaConf.create({"path": str(path), "every_n_steps": 1, "max_batches": None})
    tokenizer = AutoTokenizer.from_pretrained(recipe_path("tokenizer"))
    world = dist.get_world_size()
    rank, cpu = dist.get_rank(), torch.device("cpu")
    split = Validator(
        val_cfg,
        lambda path: held_out_batches(path, data_cfg, tokenizer, rank, world),
        dp_rank=rank,
        device=cpu,
        output_dir=work_dir,
    )
    whole = Validator(
        val_cfg,
        lambda path: held_out_batches(path, data_cfg, tokenizer),
        dp_rank=0,
        device=cpu,
        output_dir=work_dir / "whole",
    )
    # Every rank scoring the whole file: the all-reduce adds `world` copies of the same sums.
    return {"split": split.run(model, step=1), "whole": whole.run(model, step=1), "world": world}


def main(result_file: str) -> None:
    dist_config, device = setup_distributed(require_process_group=True)
    meshes = build_meshes(dist_config, device)
    results = {"world_size": dist_config.world_size, "init": init_stats(meshes), "seeded": seeded(meshes)}
    results["validation"] = validation(meshes, Path(result_file).parent)
    if dist_config.is_main_process():
        with open(result_file, "w") as fh:
            json.dump(results, fh)
    # Both ranks reach the end before either tears gloo down: a rank leaving early aborts the other's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without interpreter finalization: there, gloo's worker threads can still hold collective work objects
    # whose destruction aborts the process (SIGABRT, "terminate called without an active exception") after the
    # work is done and reported; it hit CI about once in ten runs. Nothing is left to flush but stdout.
    sys.stdout.flush()
    os._exit(0)
