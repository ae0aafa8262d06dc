"""The training scripts on GPUs with the TransformerEngine backend (skipped on machines without them).

The 8M-parameter L0 sanity model trains for 100 steps; the references are the same as on CPU: loss below the
residue background entropy, and an export that reproduces the checkpointed weights.
"""

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from compensated_adamw import split_master
from convert import convert_esm_hf_to_te
from launch import run_script
from safetensors.torch import load_file
from test_finetune import NO_LEARNING, assert_export_holds
from test_train import (
    FAST,
    LOSS_THRESHOLD,
    assert_export_reproduces_checkpoint,
    assert_same_training_to_float32_rounding,
    assert_validation_is_the_exports_held_out_loss,
    load_export,
    read_metrics,
)


# L0_sanity's batching: its held-out file is scored at steps 50 and 100 (VALIDATE); the CPU evaluation of the export
# must agree with the TE run's to bf16 precision. Between steps 50 and 100 some runs (DDP, BSHD: 8 sequences a step)
# sit on the plateau near the residue background entropy (2.82 then 2.82 on an H200), so falling is not asserted.
L0_BATCHING = {"max_seq_length": 128, "micro_batch_size": 8, "token_budget": 1024}
VALIDATE = "validation.every_n_steps=50"


def train_on_gpu(
    script: str,
    output_dir: Path,
    *overrides: str,
    nproc: int | None = None,
    steps: int = 100,
    config_name: str | None = None,
    env: dict | None = None,
) -> list[dict]:
    """``steps`` steps, logged every 10, with a checkpoint halfway (the export is compared with the last one)."""
    # Hydra's --config-name goes before the overrides: argparse takes no positional arguments after an option.
    config = ["--config-name", config_name] if config_name else []
    schedule = [f"num_train_steps={steps}", "logger.log_every=10", f"checkpoint.save_every={steps // 2}"]
    args = [*config, f"output_dir={output_dir}", *schedule, *overrides]
    run_script(script, *args, nproc=nproc, cpu_only=False, timeout=600, env=env)
    return read_metrics(output_dir)


def assert_validated_at(output_dir: Path, steps: list[int]) -> None:
    """validation.jsonl holds ``steps`` (L0_sanity's schedule) with a held-out loss below the start, ln(33) ~ 3.5."""
    records = [json.loads(line) for line in (output_dir / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == steps and all(r["val_loss"] < 3.3 for r in records), records


def assert_learned(metrics: list[dict], threshold: float = LOSS_THRESHOLD, last_steps: int = 20) -> None:
    final = [m["loss"] for m in metrics if m["step"] > metrics[-1]["step"] - last_steps]
    assert sum(final) / len(final) < threshold, [round(m["loss"], 3) for m in metrics]


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", ["dataset.input_format=bshd"]),
        ("train_fsdp2.py", ["dataset.input_format=thd"]),
        ("train_fsdp2.py", ["dataset.input_format=thd", "checkpoint.async_save=true", "use_torch_compile=true"]),
        # bf16 weights: CompensatedAdamW's Triton kernel updates them.
        ("train_ddp.py", ["dataset.input_format=thd", "mixed_precision.fp32_master_weights=false"]),
        # FusedResidualTransformerLayer (residual adds inside the LayerNorm kernels) in place of TE's layer
        (
            "train_ddp.py",
            [
                "dataset.input_format=thd",
                "mixed_precision.fp32_master_weights=false",
                "+model_config_overrides.fused_residual_norm=true",
            ],
        ),
        # ... with fp32 master weights as fp32 weights (the default): the weight-gradient GEMMs write float32 gradients
        ("train_ddp.py", ["dataset.input_format=thd", "+model_config_overrides.fused_residual_norm=true"]),
        ("train_fsdp2.py", ["dataset.input_format=bshd", "+model_config_overrides.fused_residual_norm=true"]),
        ("train_ddp.py", ["dataset.input_format=thd", "use_torch_compile=true"]),
    ],
    ids=[
        "ddp-bshd",
        "fsdp2-thd",
        "fsdp2-async-compile",
        "ddp-bf16-weights",
        "ddp-fused-residual",
        "ddp-fused-residual-fp32-masters",
        "fsdp2-fused-residual",
        "ddp-compile",
    ],
)
def test_te_backend_learns_and_exports(tmp_path, script, overrides):
    metrics = train_on_gpu(script, tmp_path, "+model_config_overrides.backend=te", VALIDATE, *overrides)
    assert_learned(metrics)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gb"] > 0 and summary["median_mfu"] > 0
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    input_format = next(o.split("=")[1] for o in overrides if o.startswith("dataset.input_format="))
    assert_validation_is_the_exports_held_out_loss(
        tmp_path, [50, 100], L0_BATCHING, input_format, rel=0.02, falls=False
    )


@pytest.mark.requires_te
@pytest.mark.parametrize(
    "fp8_recipe",
    [
        None,
        pytest.param("DelayedScaling", marks=pytest.mark.requires_fp8),
        pytest.param("Float8BlockScaling", marks=pytest.mark.requires_fp8),
    ],
)
def test_activation_recompute_with_te_and_fsdp2_trains_like_keeping_activations(tmp_path, fp8_recipe):
    """TE layers under FSDP2 with every layer's activations recomputed in backward (bf16, and FP8 with delayed or block
    scaling): the logged losses follow the plain run's (not bit for bit: TE's backward kernels are not run-to-run
    exact) and the step's peak memory is lower."""
    overrides = ["+model_config_overrides.backend=te", "dataset.input_format=thd", "dataset.pad_to_multiple_of=16"]
    if fp8_recipe:
        overrides += ["fp8_config.enabled=true", f"fp8_config.fp8_recipe={fp8_recipe}"]
    plain = train_on_gpu("train_fsdp2.py", tmp_path / "plain", *overrides, steps=30)
    recomputed = train_on_gpu(
        "train_fsdp2.py", tmp_path / "recompute", *overrides, "+model_config_overrides.recompute_layers=6", steps=30
    )
    assert [m["loss"] for m in recomputed] == pytest.approx([m["loss"] for m in plain], rel=2e-2)
    peak = {
        run: json.loads((tmp_path / run / "summary.json").read_text())["peak_memory_gb"]
        for run in ("plain", "recompute")
    }
    assert peak["recompute"] < peak["plain"], peak


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_layers_learn(tmp_path, recipe):
    overrides = [
        "dataset.input_format=thd",
        "dataset.pad_to_multiple_of=16",
        "fp8_config.enabled=true",
        f"fp8_config.fp8_recipe={recipe}",
        "fp8_config.fp8_layers=[2,3,4,5]",  # first and last layers stay in bf16, a common choice
    ]
    # FP8 steps are noisier at this learning rate: the mean of the last 40 steps must beat the residue background
    # entropy (~2.9 nats), which still needs context.
    assert_learned(train_on_gpu("train_fsdp2.py", tmp_path, *overrides), threshold=2.9, last_steps=40)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated_at(tmp_path, [75])  # the held-out pass under FP8 (no_grad, eval)


@pytest.mark.requires_fp8
@pytest.mark.parametrize(
    ("script", "recipe"), [("train_ddp.py", "DelayedScaling"), ("train_fsdp2.py", "Float8BlockScaling")]
)
def test_fp8_fused_layers_learn(tmp_path, script, recipe):
    """ESM-2's fused layers in FP8 (every layer; the L1 configs' FP8 runs): the run keeps them (no fallback to TE's
    layers), learns, exports and validates."""
    overrides = [
        "dataset.input_format=thd",
        "dataset.pad_to_multiple_of=16",
        "fp8_config.enabled=true",
        f"fp8_config.fp8_recipe={recipe}",
        "+model_config_overrides.fused_residual_norm=true",
    ]
    assert_learned(train_on_gpu(script, tmp_path, *overrides), threshold=2.9, last_steps=40)
    assert json.loads((tmp_path / "final_model" / "config.json").read_text())["fused_residual_norm"] is True
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated_at(tmp_path, [75])  # the held-out pass under FP8 (no_grad, eval)


@pytest.mark.requires_fp8
def test_fp8_with_bshd_input_learns(tmp_path):
    """Padded BSHD batches under FP8: the model unpads them and pads the token count to a multiple of 128 itself."""
    overrides = [
        "dataset.input_format=bshd",
        "fp8_config.enabled=true",
        "fp8_config.fp8_recipe=Float8CurrentScaling",
        "fp8_config.fp8_layers=[2,3,4,5]",
    ]
    assert_learned(train_on_gpu("train_ddp.py", tmp_path, *overrides), threshold=2.9, last_steps=40)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated_at(tmp_path, [75])  # the held-out pass under FP8 (no_grad, eval)


@pytest.mark.requires_fp8
@pytest.mark.skipif(importlib.util.find_spec("nvdlfw_inspect") is None, reason="nvidia-dlframework-inspect missing")
def test_fp8_tensor_statistics_are_logged(tmp_path):
    overrides = [
        "dataset.input_format=thd",
        "dataset.pad_to_multiple_of=16",
        "fp8_config.enabled=true",
        "fp8_config.fp8_recipe=Float8CurrentScaling",
        "quant_stats.enabled=true",
    ]
    train_on_gpu("train_fsdp2.py", tmp_path, *overrides)
    logs = "".join(p.read_text() for p in (tmp_path / "quant_stats").rglob("*.log"))
    assert "underflows%" in logs and "layernorm_qkv" in logs, logs[:2000]


@pytest.mark.requires_blackwell
def test_mxfp8_and_nvfp4_layers_learn(tmp_path):
    overrides = [
        "dataset.input_format=thd",
        "dataset.pad_to_multiple_of=32",
        "fp8_config.enabled=true",
        "fp8_config.fp8_recipe=MXFP8BlockScaling",
        "fp4_config.enabled=true",
        "fp4_config.fp4_layers=[3,4]",  # the other layers run in MXFP8
    ]
    assert_learned(train_on_gpu("train_fsdp2.py", tmp_path, *overrides))


needs_megatron_fsdp = pytest.mark.skipif(
    importlib.util.find_spec("megatron_fsdp") is None, reason="megatron-fsdp is not installed"
)
# TE's fused attention runs a deterministic backward only when asked to; GEMMs and norms are run-to-run exact. With it,
# two TE runs of the same steps log the same losses bit for bit, which the exactness tests below rely on.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


@pytest.mark.requires_gpu
@needs_megatron_fsdp
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["+model_config_overrides.fused_residual_norm=true"],
        ["use_torch_compile=true"],
    ],
    ids=["te-layers", "fused-residual", "compile"],
)
def test_megatron_fsdp_learns_and_exports(tmp_path, overrides):
    metrics = train_on_gpu("train_mfsdp.py", tmp_path, "dataset.input_format=thd", VALIDATE, *overrides, nproc=1)
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validation_is_the_exports_held_out_loss(tmp_path, [50, 100], L0_BATCHING, "thd", rel=0.02, falls=False)


def assert_same_run(first: Path, second: Path) -> None:
    """Two runs' logged losses, gradient norms and held-out losses bit for bit, and their exported weights."""
    metrics = [read_metrics(first), read_metrics(second)]
    assert [m["step"] for m in metrics[1]] == [m["step"] for m in metrics[0]]
    assert [m["loss"] for m in metrics[1]] == [m["loss"] for m in metrics[0]]
    assert [m["grad_norm"] for m in metrics[1]] == [m["grad_norm"] for m in metrics[0]]
    held_out = [
        [json.loads(line) for line in (run / "validation.jsonl").read_text().splitlines()] for run in (first, second)
    ]
    assert [r["val_loss"] for r in held_out[1]] == [r["val_loss"] for r in held_out[0]] and held_out[0]
    expected = load_export(first).state_dict()
    for name, value in load_export(second).state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.requires_te
@pytest.mark.parametrize("config_name", ["L0_sanity", "L0_sanity_amplify"], ids=["esm2", "amplify"])
def test_fp32_masters_held_in_the_optimizer_train_as_fp32_weights_do_with_te(tmp_path, config_name):
    """``mixed_precision.masters_in_optimizer`` (on in L1_650M and L1_amplify_350M) with the fused TE layers: bf16
    weights into the GEMMs, the float32 init's low 16 bits in CompensatedAdamW's Triton kernel, float32 moments,
    against fp32 weights cast per GEMM, both through train_ddp.py with deterministic attention, 100 steps. The losses
    agree to 0.02 at every logged step to step 50 (ESM-2: 0.0004 at most on an H100) and to 0.1 after it (ESM-2's
    loss spike near step 60 grows the two paths' rounding differences to 0.026 there on an H100), both learn, and
    the export holds float32 weights whose split (as the optimizer splits them) is the checkpoint's bf16 weights,
    their low bits in use."""
    common = ["+model_config_overrides.backend=te", "+model_config_overrides.fused_residual_norm=true"]
    common += ["dataset.input_format=thd", "validation.path=null"]
    runs = {
        name: train_on_gpu(
            "train_ddp.py",
            tmp_path / name,
            *common,
            f"mixed_precision.masters_in_optimizer={on}",
            config_name=config_name,
            env=DETERMINISTIC,
        )
        for name, on in [("fp32", "false"), ("split", "true")]
    }
    assert [m["step"] for m in runs["split"]] == [m["step"] for m in runs["fp32"]] == list(range(10, 101, 10))
    for fp32, split in zip(runs["fp32"], runs["split"]):
        assert abs(fp32["loss"] - split["loss"]) < (0.02 if fp32["step"] <= 50 else 0.1), runs
    assert_learned(runs["fp32"])
    assert_learned(runs["split"])
    model_state = torch.load(tmp_path / "split/checkpoints/step_100/train_state.pt", weights_only=True)["model"]
    exported = load_file(tmp_path / "split/final_model/model.safetensors")
    for name, weight in exported.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(split_master(weight)[0], model_state[name].cpu()), name
    assert any(not torch.equal(weight, weight.bfloat16().float()) for weight in exported.values())


@pytest.mark.requires_te
@needs_megatron_fsdp
@pytest.mark.parametrize("fp32_master_weights", [True, False], ids=["fp32-main-weights", "bf16-weights"])
def test_megatron_fsdp_stop_and_go_matches_uninterrupted_run(tmp_path, fp32_master_weights):
    """Megatron-FSDP with TE layers in bf16, THD, two micro-batches a step, asynchronous saves: 60 steps in one go and
    30 + resume + 30 log the same losses, gradient norms and held-out losses bit for bit and export the same weights.
    So a checkpoint restores the fp32 main weights (not the bf16 compute weights they are rounded to), or the bf16
    weights with CompensatedAdamW's low bits, and the AdamW moments and step count, the schedule and the data
    position."""
    common = [
        "+model_config_overrides.backend=te",
        "dataset.input_format=thd",
        f"mixed_precision.fp32_master_weights={str(fp32_master_weights).lower()}",
        "grad_acc_steps=2",
        "checkpoint.async_save=true",
        "logger.log_every=1",
        "validation.every_n_steps=20",
    ]
    train_on_gpu("train_mfsdp.py", tmp_path / "full", *common, nproc=1, steps=60, env=DETERMINISTIC)
    stopped = [*common, "num_train_steps=30"]
    train_on_gpu("train_mfsdp.py", tmp_path / "resumed", *stopped, nproc=1, steps=60, env=DETERMINISTIC)
    train_on_gpu("train_mfsdp.py", tmp_path / "resumed", *common, nproc=1, steps=60, env=DETERMINISTIC)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 61))
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


# Runs compared to float32 rounding: torch backend in float32 (PyTorch's default keeps TF32 off), padded batches.
FLOAT32_TORCH = [
    "+model_config_overrides.backend=torch",
    "mixed_precision.enabled=false",
    "dataset.input_format=bshd",
    "adamw_kwargs.eps=1e-3",  # Adam divides by sqrt(v) + eps: keep float noise in tiny gradients from flipping signs
    "logger.log_every=1",
]


@pytest.mark.requires_gpu
@needs_megatron_fsdp
def test_megatron_fsdp_grad_accumulation_equals_one_larger_batch(tmp_path):
    """grad_acc_steps=2 x 4 sequences == 1 x 8 on one GPU in float32 (torch backend; PyTorch's default keeps TF32
    off): Megatron-FSDP sums the micro-batches' gradients in its main-gradient buffer and the token weights make the
    sum one batch's gradient. The same losses, gradient norms and exported weights, to float32 rounding."""
    common = FLOAT32_TORCH
    train_on_gpu(
        "train_mfsdp.py", tmp_path / "acc", *common, "dataset.micro_batch_size=4", "grad_acc_steps=2", nproc=1, steps=4
    )
    train_on_gpu(
        "train_mfsdp.py", tmp_path / "big", *common, "dataset.micro_batch_size=8", "grad_acc_steps=1", nproc=1, steps=4
    )
    assert_same_training_to_float32_rounding(tmp_path / "acc", tmp_path / "big")


@pytest.mark.requires_gpu
@needs_megatron_fsdp
def test_megatron_fsdp_on_one_gpu_trains_as_ddp_does(tmp_path):
    """One GPU, float32, torch backend (no TF32): Megatron-FSDP and DDP (which trains the bare model on one process)
    build the same model from the seed, read the same batches and run torch's fused AdamW, so they log the same
    losses and gradient norms and export the same weights, to float32 rounding. Before Megatron-FSDP's
    state-building optimizer step was left out (adamw.megatron_fsdp_init_step_left_out), its first update was
    bias-corrected as a second one and its losses parted from DDP's at step 2."""
    common = FLOAT32_TORCH
    train_on_gpu("train_mfsdp.py", tmp_path / "mfsdp", *common, nproc=1, steps=6)
    train_on_gpu("train_ddp.py", tmp_path / "ddp", *common, nproc=1, steps=6)
    assert_same_training_to_float32_rounding(tmp_path / "mfsdp", tmp_path / "ddp")


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_with_bf16_weights_trains_as_ddp_does(tmp_path):
    """bf16 weights on one GPU (TE layers, THD): Megatron-FSDP's bf16 shards with bf16 gradients and DDP's bf16 model
    both train with CompensatedAdamW from the same seed and batches, so they log the same losses to bf16 noise (the
    low bits' random start follows each optimizer's parameter layout, so not bit for bit). A run that dropped the
    updates, or applied Megatron-FSDP's state-building step, would part from DDP's within the first steps."""
    common = ["+model_config_overrides.backend=te", "dataset.input_format=thd", "logger.log_every=1"]
    common += ["mixed_precision.fp32_master_weights=false"]
    mfsdp = train_on_gpu("train_mfsdp.py", tmp_path / "mfsdp", *common, nproc=1, steps=30, env=DETERMINISTIC)
    ddp = train_on_gpu("train_ddp.py", tmp_path / "ddp", *common, nproc=1, steps=30, env=DETERMINISTIC)
    assert [m["step"] for m in mfsdp] == [m["step"] for m in ddp] == list(range(1, 31))
    assert [m["loss"] for m in mfsdp] == pytest.approx([m["loss"] for m in ddp], rel=1e-2, abs=0)


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_main_weights_start_from_the_float32_initialisation(tmp_path):
    """bf16 compute over fp32 main weights (the default; TE layers): with lr 0, Megatron-FSDP's export, gathered from
    its main weights, holds DDP's float32 initialisation of the same seed exactly. Before the fix, fully_shard built
    the main weights from the model already cast to bf16, and the export held that initialisation rounded to bf16
    (ESM-2 650M then logged 3.56 at step 10 where bf16-weights runs logged 3.25; docs/benchmarks.md)."""
    common = ["+model_config_overrides.backend=te", "dataset.input_format=thd", *NO_LEARNING]
    for script in ("train_mfsdp.py", "train_ddp.py"):
        run_script(script, f"output_dir={tmp_path / script}", *common, nproc=1, cpu_only=False, timeout=600)
    mfsdp, ddp = (load_export(tmp_path / script).state_dict() for script in ("train_mfsdp.py", "train_ddp.py"))
    assert mfsdp.keys() == ddp.keys()
    for key, value in ddp.items():
        assert torch.equal(mfsdp[key], value), key
    # The test can tell: the weight matrices' random initialisation lies between bf16 values (biases start at 0).
    weights = [value for value in ddp.values() if value.dim() == 2 and value.numel() > 1000]
    assert all(not torch.equal(value, value.bfloat16().float()) for value in weights)


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_activation_recompute_trains_exactly_like_keeping_activations(tmp_path):
    """Every layer recomputed in backward inside Megatron-FSDP's gather/release hooks (TE, bf16, THD): the same losses
    and gradient norms as keeping the activations, bit for bit, and a lower peak memory."""
    common = ["+model_config_overrides.backend=te", "dataset.input_format=thd", "logger.log_every=1"]
    common += ["validation.every_n_steps=15"]
    train_on_gpu("train_mfsdp.py", tmp_path / "plain", *common, nproc=1, steps=30, env=DETERMINISTIC)
    recompute = [*common, "+model_config_overrides.recompute_layers=6"]
    train_on_gpu("train_mfsdp.py", tmp_path / "recompute", *recompute, nproc=1, steps=30, env=DETERMINISTIC)
    assert_same_run(tmp_path / "plain", tmp_path / "recompute")
    peak = {
        run: json.loads((tmp_path / run / "summary.json").read_text())["peak_memory_gb"]
        for run in ("plain", "recompute")
    }
    assert peak["recompute"] < peak["plain"], peak


two_gpus = pytest.mark.requires_multi_gpu


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides", "nproc"),
    [
        ("train_ddp.py", ["dataset.input_format=thd"], 1),
        ("train_fsdp2.py", ["dataset.input_format=thd", "+model_config_overrides.fused_residual_norm=true"], 1),
        pytest.param("train_mfsdp.py", ["dataset.input_format=thd"], 1, marks=needs_megatron_fsdp),
        # Two ranks: each copies its own rows of every full tensor into its shard (common/pretrained_weights.py).
        pytest.param("train_fsdp2.py", ["dataset.input_format=thd"], 2, marks=two_gpus),
        pytest.param("train_mfsdp.py", ["dataset.input_format=thd"], 2, marks=[needs_megatron_fsdp, two_gpus]),
    ],
    ids=["ddp-te-layers", "fsdp2-fused-residual", "mfsdp", "fsdp2-2gpu", "mfsdp-2gpu"],
)
def test_finetune_on_gpu_from_a_stock_checkpoint_and_from_its_export(
    tmp_path, stock_checkpoint, script, overrides, nproc
):
    """A stock Hugging Face ESM-2 checkpoint loaded into the TE model on GPUs (converted on load; FSDP2 and
    Megatron-FSDP shard the model first and each rank loads its shard): with lr 0 the export holds the stock weights
    exactly, and the export loaded in its turn gives them again. The log names the TE backend, so the weights went
    through TE's layers."""
    path, hf_model = stock_checkpoint
    expected = convert_esm_hf_to_te(hf_model, backend="torch").state_dict()
    source = path
    for run in ("from_stock", "from_export"):
        result = run_script(
            script, f"output_dir={tmp_path / run}", f"model_tag={source}", "init_from_pretrained=true", *FAST,
            *NO_LEARNING, "+model_config_overrides.backend=te", *overrides, nproc=nproc, cpu_only=False, timeout=600,
        )  # fmt: skip
        assert "Model: te backend" in result.stdout + result.stderr
        assert_export_holds(tmp_path / run, expected, "NVEsmForMaskedLM")
        source = tmp_path / run / "final_model"


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize("overrides", [[], ["use_torch_compile=true"]], ids=["eager", "compile"])
def test_context_parallel_learns_and_exports(tmp_path, overrides):
    """TE's ring attention over 2 GPUs (THD): learns, exports the checkpoint's weights, and the held-out loss logged
    at steps 50 and 100 (each CP rank scoring its share of every held-out sequence) equals one CPU process scoring the
    export. Also with torch.compile."""
    metrics = train_on_gpu("train_cp.py", tmp_path, VALIDATE, *overrides, nproc=2, config_name="L0_sanity_cp")
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    cp_batching = {"max_seq_length": 256, "micro_batch_size": 8, "token_budget": 4096}  # L0_sanity_cp's
    assert_validation_is_the_exports_held_out_loss(
        tmp_path, [50, 100], cp_batching, "thd", cp_size=2, rel=0.02, falls=False
    )


@pytest.mark.requires_multi_gpu
@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py", "train_mfsdp.py"])
def test_two_gpus_learn(tmp_path, script):
    if script == "train_mfsdp.py" and importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    assert_learned(train_on_gpu(script, tmp_path, "dataset.input_format=thd", nproc=2))
    if script == "train_mfsdp.py":  # the sharded checkpoint and the gathered export, written by two ranks
        assert_export_reproduces_checkpoint(tmp_path, step=100)


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_context_parallel_stop_and_go_matches_uninterrupted_run(tmp_path):
    """CP over 2 GPUs with TE, two micro-batches a step: 40 steps in one go and 20 + resume + 20 log the same
    losses, gradient norms and held-out losses bit for bit and export the same weights (TE's deterministic attention
    backward)."""
    common = ["grad_acc_steps=2", "logger.log_every=1", "validation.every_n_steps=20"]
    run = functools.partial(
        train_on_gpu, "train_cp.py", nproc=2, steps=40, config_name="L0_sanity_cp", env=DETERMINISTIC
    )
    run(tmp_path / "full", *common)
    run(tmp_path / "resumed", *common, "num_train_steps=20")
    run(tmp_path / "resumed", *common)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 41))
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_resume_on_one_gpu_continues_a_two_gpu_run(tmp_path):
    """Megatron-FSDP, THD: 50 steps on 2 GPUs, then the same command on 1 GPU resumes them (its checkpoint re-sharded
    for one rank: fp32 main weights, AdamW moments, schedule), reads the epoch's sequences that neither rank had read,
    trains to 100 and exports the final checkpoint's weights. Restored, not restarted: the first resumed step's loss
    is the 2-GPU run's, not a fresh model's ln(33) = 3.5."""
    common = ["+model_config_overrides.backend=te", "dataset.input_format=thd", "logger.log_every=1"]
    train_on_gpu("train_mfsdp.py", tmp_path, *common, "num_train_steps=50", nproc=2)
    before = read_metrics(tmp_path)
    args = [f"output_dir={tmp_path}", "num_train_steps=100", "checkpoint.save_every=50", *common]
    result = run_script("train_mfsdp.py", *args, nproc=1, cpu_only=False, timeout=600)
    log = result.stdout + result.stderr
    assert "was written by 2 ranks, this run has 1" in log
    assert "2 DP ranks had read" in log and "dealt out to 1 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 101))
    last_two_gpu = sum(m["loss"] for m in before[-5:]) / 5
    assert metrics[50]["loss"] < last_two_gpu + 0.3 < 3.3, (last_two_gpu, metrics[50]["loss"])
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
