"""train_fsdp2.py, train_ddp.py, train_cp.py and the evaluation script on GPUs with the TransformerEngine backend (skipped without them).

The references are those of the CPU tests:
the loss must fall below ln 4 (which needs context), the export must load and score like the trained model, and the
FP8 run must put exactly the layers the config asks for in FP8.
"""

import json
import re

import pytest
import torch
from launch import run_script
from safetensors.torch import load_file
from training import LOSS_THRESHOLD, read_jsonl, train


GPU_STEPS = ["num_train_steps=80", "validation.every_n_steps=40", "lr_scheduler_kwargs.num_decay_steps=70"]
# TE's fused attention runs a deterministic backward only when asked to; GEMMs and norms are run-to-run exact. With it,
# two TE runs of the same steps log the same losses bit for bit.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def evaluate(checkpoint, output, *args: str) -> dict:
    run_script(
        "scripts/evaluate_fasta_lm_loss.py",
        str(checkpoint),
        "data/sanity_eval.fasta",
        "--window-length",
        "256",
        "--output",
        str(output),
        *args,
        cpu_only="cpu" in args,
    )
    return json.loads(output.read_text())


@pytest.mark.requires_te
# bf16 weights: CompensatedAdamW's Triton kernel updates each FSDP2 shard.
@pytest.mark.parametrize(
    "weights",
    [[], ["mixed_precision.fp32_master_weights=false"], ["+model_config_overrides.fused_residual_norm=true"]],
    ids=["fp32_master", "bf16", "fused_layers"],
)
def test_te_backend_fsdp2_learns_and_exports(tmp_path, weights):
    metrics = train(tmp_path, *GPU_STEPS, "+model_config_overrides.backend=te", *weights, cpu_only=False)
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]
    assert read_jsonl(tmp_path / "validation.jsonl")[-1]["val_loss"] < LOSS_THRESHOLD
    assert json.loads((tmp_path / "summary.json").read_text())["peak_memory_gb"] > 0

    # The export scores the evaluation FASTA alike with TE in bf16 on the GPU and with the torch backend in fp32 on CPU.
    on_gpu = evaluate(tmp_path / "final_model", tmp_path / "gpu.json", "--backend", "te", "--device", "cuda")
    on_cpu = evaluate(tmp_path / "final_model", tmp_path / "cpu.json", "--backend", "torch", "--device", "cpu")
    assert on_gpu["precision"] == "bf16" and on_gpu["token_weighted_nll"] < LOSS_THRESHOLD
    assert on_gpu["token_weighted_nll"] == pytest.approx(on_cpu["token_weighted_nll"], abs=0.03)


@pytest.mark.requires_te
def test_te_backend_ddp_with_the_fused_layers_learns_and_exports(tmp_path):
    """train_ddp.py as og2_1b_thd's one-GPU benchmark runs it: TE's fused layers (full windows attended as one dense
    batch), fp32 master weights held in the optimizer (bf16 weights into the GEMMs, their low bits and float32 moments
    in CompensatedAdamW), the model without a wrapper; the export holds the float32 masters and scores as the trained
    model, with TE on the GPU and with the torch backend on CPU."""
    fused = ["+model_config_overrides.backend=te", "+model_config_overrides.fused_residual_norm=true"]
    fused += ["mixed_precision.masters_in_optimizer=true"]
    metrics = train(tmp_path, *GPU_STEPS, *fused, script="train_ddp.py", cpu_only=False)
    exported = load_file(tmp_path / "final_model" / "model.safetensors")
    assert all(weight.dtype == torch.float32 for weight in exported.values())
    assert any(not torch.equal(weight, weight.bfloat16().float()) for weight in exported.values())  # low bits in use
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]
    assert read_jsonl(tmp_path / "validation.jsonl")[-1]["val_loss"] < LOSS_THRESHOLD
    on_gpu = evaluate(tmp_path / "final_model", tmp_path / "gpu.json", "--backend", "te", "--device", "cuda")
    on_cpu = evaluate(tmp_path / "final_model", tmp_path / "cpu.json", "--backend", "torch", "--device", "cpu")
    assert on_gpu["token_weighted_nll"] < LOSS_THRESHOLD
    assert on_gpu["token_weighted_nll"] == pytest.approx(on_cpu["token_weighted_nll"], abs=0.03)


@pytest.mark.requires_fp8
@pytest.mark.parametrize(("recipe", "layers"), [("Float8CurrentScaling", "te"), ("DelayedScaling", "fused")])
def test_fp8_with_first_and_last_layers_in_bf16_learns(tmp_path, recipe, layers):
    """4 layers, keep_first_last_bf16=1: layers 2 and 3 in FP8 (not Float8BlockScaling: the tiny shape's FFN width 448
    is not a multiple of its 128-wide blocks), with TE's layers or with the fused layers og2_1b_thd builds, whose
    bf16 and FP8 layers then sit in one stack."""
    overrides = [
        f"output_dir={tmp_path}",
        *GPU_STEPS,
        "+model_config_overrides.backend=te",
        "+model_config_overrides.num_hidden_layers=4",
        f"+model_config_overrides.fused_residual_norm={str(layers == 'fused').lower()}",
        "fp8_config.enabled=true",
        f"fp8_config.fp8_recipe={recipe}",
        "fp8_config.keep_first_last_bf16=1",
    ]
    result = run_script("train_fsdp2.py", *overrides, cpu_only=False)
    log = result.stdout + result.stderr
    assert "Per-layer precision: [None, 'fp8', 'fp8', None]" in log
    assert ("(FusedResidualTransformerLayer:" in log) == (layers == "fused"), log[-3000:]
    assert "fused_residual_norm is off" not in log, log[-3000:]
    if recipe == "DelayedScaling":  # fp8_calibration.py: every gradient scale set before step 1, 4 GEMMs x 2 layers
        assert re.search(r"DelayedScaling: [2-5] forward/backward passes .* set 8 gradient scales before step 1", log)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[-1]["loss"] < 1.3, [round(m["loss"], 3) for m in metrics]
    exported = json.loads((tmp_path / "final_model" / "config.json").read_text())
    assert exported["layer_precision"] is None  # the export loads anywhere, without FP8


@pytest.mark.requires_te
def test_activation_recompute_with_te_trains_exactly_like_keeping_activations(tmp_path):
    """Both layers recomputed in backward under FSDP2 (TE, THD, causal, fp32 master weights; TE's attention asked for
    its deterministic backward): the same losses, gradient norms and held-out losses as keeping the activations, bit
    for bit, and a lower peak memory."""
    common = ["+model_config_overrides.backend=te", "num_train_steps=30", "logger.log_every=1"]
    common += ["validation.every_n_steps=15"]
    plain = train(tmp_path / "plain", *common, cpu_only=False, env=DETERMINISTIC)
    recompute = [*common, "+model_config_overrides.recompute_layers=2"]
    recomputed = train(tmp_path / "recompute", *recompute, cpu_only=False, env=DETERMINISTIC)
    assert [m["loss"] for m in recomputed] == [m["loss"] for m in plain]
    assert [m["grad_norm"] for m in recomputed] == [m["grad_norm"] for m in plain]
    held_out = [read_jsonl(tmp_path / run / "validation.jsonl") for run in ("plain", "recompute")]
    assert [r["val_loss"] for r in held_out[1]] == [r["val_loss"] for r in held_out[0]] and len(held_out[0]) == 2
    assert plain[-1]["loss"] < plain[0]["loss"] - 1.0  # the run did train
    peak = {
        run: json.loads((tmp_path / run / "summary.json").read_text())["peak_memory_gb"]
        for run in ("plain", "recompute")
    }
    assert peak["recompute"] < peak["plain"], peak


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_ddp.py"])
def test_two_gpus_learn(tmp_path, script):
    metrics = train(tmp_path, *GPU_STEPS, "export_final_model=false", nproc=2, script=script, cpu_only=False)
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]
    assert read_jsonl(tmp_path / "validation.jsonl")[-1]["val_loss"] < LOSS_THRESHOLD


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_two_gpus_stop_and_go_matches_an_uninterrupted_run(tmp_path):
    """As the CPU test, with NCCL and TE: 4 + 4 steps equal 8 steps (to bf16 reduction-order tolerance)."""
    common = [
        "dataset.token_budget=300",
        "logger.log_every=1",
        "validation.every_n_steps=4",
        "validation.max_batches=2",
    ]
    straight = train(tmp_path / "straight", "num_train_steps=8", *common, nproc=2, cpu_only=False)
    train(tmp_path / "resumed", "num_train_steps=4", "export_final_model=false", *common, nproc=2, cpu_only=False)
    resumed = train(tmp_path / "resumed", "num_train_steps=8", *common, nproc=2, cpu_only=False)
    assert [m["loss"] for m in resumed[4:]] == pytest.approx([m["loss"] for m in straight[4:]], rel=1e-3)


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_two_gpus_context_parallel_learns(tmp_path):
    """TE ring attention, cp_size=2 (the CPU twin of this test proves CP = one process numerically)."""
    metrics = train(
        tmp_path, *GPU_STEPS, "+model_config_overrides.backend=te", nproc=2, script="train_cp.py", cpu_only=False
    )
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]
    assert read_jsonl(tmp_path / "validation.jsonl")[-1]["val_loss"] < LOSS_THRESHOLD
