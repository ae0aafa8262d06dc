"""torchrun worker for test_init.py: build models with model_setup.build_model (the code train_fsdp2.py runs) and
report, as JSON from rank 0, what the tests check.

    torchrun --nproc_per_node=N tests/fsdp_worker.py <result.json>

- ``init``: for meta-device and direct construction and each init switch, the std/mean of every gathered full weight
  and whether the two halves of the embedding (one shard per rank with 2 processes) are identical;
- ``seeded``: whether two builds with seed 7 agree and one with seed 8 differs;
- ``precision``: under the bf16 policy, the dtype of the rotary table and of the weights a layer computes with, of the
  master weights and of their gradients; and the rotary dtype FSDP2 would pass with ``cast_forward_inputs=True``;
- ``validation``: the validation metrics with the file split over the ranks (uneven: ranks run different numbers of
  batches) and with every rank reading all of it.
"""

import gzip
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import build_meshes, setup_distributed
from model_setup import build_model, mixed_precision_policy, recipe_path
from modeling_llama_te import NVLlamaConfig
from omegaconf import OmegaConf
from quantization import QuantizationPlan
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoTokenizer
from validation import Validator


SWITCHES = {"off": (None, False), "spike_no_more": (1.0, False), "scaled_output": (None, True), "both": (1.0, True)}
FP32 = MixedPrecisionPolicy(cast_forward_inputs=False)


def config(embedding_init_std=None, scale_output_projection_init=False) -> NVLlamaConfig:
    # 8 layers, so depth scaling (0.02 / 4 = 0.005) is far from the plain 0.02; 65,536-entry matrices, so each std is
    # measured to about 0.3%.
    return NVLlamaConfig.from_pretrained(
        recipe_path("model_configs/llama3-tiny-nucleotide"),
        backend="torch",
        num_hidden_layers=8,
        hidden_size=256,
        intermediate_size=512,
        embedding_init_std=embedding_init_std,
        scale_output_projection_init=scale_output_projection_init,
        tie_word_embeddings=False,
    )


def full_weights(model) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor().detach().float() for name, param in model.named_parameters()}  # collective


def init_stats(mesh) -> dict:
    results = {}
    for use_meta in (True, False):
        for switch, (std, scaled) in SWITCHES.items():
            model = build_model(config(std, scaled), QuantizationPlan(None), torch.device("cpu"), mesh, FP32, use_meta)
            weights = full_weights(model)
            embedding = weights["model.embed_tokens.weight"]
            results[f"{'meta' if use_meta else 'direct'}/{switch}"] = {
                "std": {name: w.std().item() for name, w in weights.items()},
                "mean": {name: w.mean().item() for name, w in weights.items()},
                "embedding_halves_equal": bool(torch.equal(embedding[:128], embedding[128:])),
            }
    return results


def seeded(mesh) -> dict:
    def weights(seed):
        return full_weights(
            build_model(config(1.0, True), QuantizationPlan(None), torch.device("cpu"), mesh, FP32, seed=seed)
        )

    first, again, other = weights(7), weights(7), weights(8)
    return {
        "same_seed_equal": all(torch.equal(first[k], again[k]) for k in first),
        "other_seed_differs": any(not torch.equal(first[k], other[k]) for k in first if "norm" not in k),
    }


def precision(mesh) -> dict:
    seen = {}
    cfg = OmegaConf.create({"mixed_precision": {"enabled": True, "on_cpu": True}})
    policies = {"recipe": mixed_precision_policy(cfg, torch.device("cpu"))}
    policies["cast_inputs"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ids = torch.randint(3, 256, (1, 64))
    batch = {"input_ids": ids, "labels": ids, "cu_seq_lens_q": torch.tensor([0, 40, 64], dtype=torch.int32)}
    for name, policy in policies.items():
        model = build_model(config(), QuantizationPlan(None), torch.device("cpu"), mesh, policy)
        attention = model.model.layers[0].self_attention

        def record(module, args, kwargs, name=name):
            seen[f"{name}/rotary"] = str(kwargs["rotary_pos_emb"].dtype)
            seen[f"{name}/compute_weight"] = str(module.proj.weight.dtype)

        attention.register_forward_pre_hook(record, with_kwargs=True)
        model(**batch).loss.backward()
        seen[f"{name}/master_weights"] = sorted({str(p.dtype) for p in model.parameters()})
        seen[f"{name}/gradients"] = sorted({str(p.grad.dtype) for p in model.parameters()})
    return seen


def validation(mesh, work_dir: Path) -> dict:
    """Three sequences over two ranks: rank 0 reads records 0 and 2 (more batches), rank 1 record 1."""
    path = work_dir / "valid.jsonl.gz"
    if dist.get_rank() == 0:
        with gzip.open(path, "wt") as fh:
            for length in (90, 40, 70):
                fh.write(json.dumps({"text": "ACGTTGCAN" * (length // 9)}) + "\n")
    dist.barrier()
    model = build_model(config(), QuantizationPlan(None), torch.device("cpu"), mesh, FP32)
    data_cfg = {"max_seq_length": 32, "window_overlap": 4, "token_budget": 48}
    val_cfg = OmegaConf.create({"path": str(path), "every_n_steps": 1, "max_batches": None})
    tokenizer = AutoTokenizer.from_pretrained(recipe_path("tokenizer"))
    world = dist.get_world_size()
    split = Validator(val_cfg, data_cfg, tokenizer, dist.get_rank(), world, torch.device("cpu"), work_dir, "disabled")
    whole = Validator(val_cfg, data_cfg, tokenizer, 0, 1, torch.device("cpu"), work_dir / "whole", "disabled")
    # Every rank scoring the whole file: the all-reduce adds `world` copies of the same sums.
    return {"split": split.run(model, step=1), "whole": whole.run(model, step=1), "world": world}


def main(result_file: str) -> None:
    dist_config, device = setup_distributed(require_process_group=True)
    mesh = build_meshes(dist_config, device).fsdp
    results = {"world_size": dist_config.world_size, "init": init_stats(mesh), "seeded": seeded(mesh)}
    results["precision"] = precision(mesh)
    results["validation"] = validation(mesh, Path(result_file).parent)
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
