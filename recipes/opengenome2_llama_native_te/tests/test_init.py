"""Initialisation statistics for each init switch, with and without the meta device, in 1 and 2 processes.

The expected standard deviations are written out from the definitions, not taken from the code: input embeddings
N(0, 1) with Spike No More (else N(0, 0.02)); the attention output projection and the MLP down projection
N(0, 0.02 / sqrt(2 * layers)) with depth scaling (else 0.02); every other matrix 0.02; norm weights exactly 1.
The 2-process runs shard every weight over both ranks (FSDP2), so each rank initialises half of each matrix.
"""

import json
import math

import pytest
import torch
from fsdp_worker import SWITCHES, config
from launch import run_script
from modeling_llama_te import NVLlamaForCausalLM


LAYERS = 8  # fsdp_worker.config()


def expected_std(name: str, embedding_init_std, scale_output_projection_init) -> float | None:
    if name.endswith(("layer_norm_weight", "norm.weight")):
        return None  # ones
    if name == "model.embed_tokens.weight":
        return embedding_init_std or 0.02
    if name.endswith(("self_attention.proj.weight", "fc2_weight")) and scale_output_projection_init:
        return 0.02 / math.sqrt(2 * LAYERS)
    return 0.02


def check_stats(stats: dict, switch: str) -> None:
    embedding_init_std, scaled = SWITCHES[switch]
    for name, std in stats["std"].items():
        expected = expected_std(name, embedding_init_std, scaled)
        if expected is None:
            assert std == 0 and stats["mean"][name] == 1, name
        else:
            assert abs(std - expected) < 0.03 * expected, (name, std, expected)
            assert abs(stats["mean"][name]) < 0.05 * expected, (name, stats["mean"][name])


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def worker_results(request, tmp_path_factory):
    result_file = tmp_path_factory.mktemp("fsdp_worker") / "result.json"
    run_script("tests/fsdp_worker.py", str(result_file), nproc=request.param)
    results = json.loads(result_file.read_text())
    assert results["world_size"] == request.param
    return results


@pytest.mark.parametrize("construction", ["meta", "direct"])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_fsdp2_init_statistics(worker_results, construction, switch):
    stats = worker_results["init"][f"{construction}/{switch}"]
    check_stats(stats, switch)
    # With 2 ranks each initialises its own half of the embedding: the halves must not repeat each other.
    assert not stats["embedding_halves_equal"]


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_plain_construction_and_meta_init_without_fsdp(switch):
    """The model on its own: direct construction, and meta-device construction + init_empty_weights()."""
    torch.manual_seed(0)
    direct = NVLlamaForCausalLM(config(*SWITCHES[switch]))
    with torch.device("meta"):
        meta = NVLlamaForCausalLM(config(*SWITCHES[switch]))
    meta.init_empty_weights("cpu")
    for model in (direct, meta):
        weights = {name: p.detach() for name, p in model.named_parameters()}
        stats = {
            "std": {n: w.std().item() for n, w in weights.items()},
            "mean": {n: w.mean().item() for n, w in weights.items()},
        }
        check_stats(stats, switch)


def test_builds_are_seeded(worker_results):
    assert worker_results["seeded"] == {"same_seed_equal": True, "other_seed_differs": True}


def test_validation_split_over_ranks_equals_one_reader(worker_results):
    """Ranks with different numbers of validation batches stay in step (FSDP2 gathers weights collectively in every
    forward) and the token-weighted result equals scoring the whole file in one place."""
    result = worker_results["validation"]
    split, whole = result["split"], result["whole"]
    assert split["val_tokens"] * result["world"] == whole["val_tokens"]
    assert split["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-6)
    assert split["val_perplexity"] == pytest.approx(math.exp(split["val_loss"]), rel=1e-9)
