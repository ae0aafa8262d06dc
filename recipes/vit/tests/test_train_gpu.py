"""The training scripts on GPUs with the TransformerEngine backend (skipped on machines without them).

The references are the CPU tests' (the L0 set's validation accuracy, the export against the checkpoint), plus: two
GPUs give the one-GPU run's losses, with FSDP and HSDP because two ranks of 16 images read the same 32 images (and
crops) per step as one rank of 32, and with tensor parallelism (TP=2) because both ranks read the one GPU's 32 images
and start from its weights; and the 224-pixel configs run at full size.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from convert import convert_vit_hf_to_te
from launch import run_script
from test_finetune import NO_LEARNING, assert_export_holds, finetune
from test_train import assert_export_holds_the_checkpoint, load_export, read_jsonl
from test_weight_decay import assert_strategy_decays_only_the_weight_matrices, zero_gradient_step


needs_megatron_fsdp = pytest.mark.skipif(
    importlib.util.find_spec("megatron_fsdp") is None, reason="megatron-fsdp is not installed"
)
TE = "++model_config_overrides.backend=te"


def train_on_gpu(script: str, output_dir: Path, images: Path, *overrides: str, nproc: int | None = 1) -> list[dict]:
    args = [f"output_dir={output_dir}", f"dataset.path={images}", "logger.log_every=10", *overrides]
    run_script(script, *args, nproc=nproc, cpu_only=False, timeout=600)
    return read_jsonl(output_dir / "metrics.jsonl")


def best_accuracy(output_dir: Path) -> float:
    return max(v["accuracy"] for v in read_jsonl(output_dir / "validation.jsonl"))


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", []),
        ("train_fsdp2.py", []),
        # bf16 weights, sharded: CompensatedAdamW's Triton kernel updates each local shard.
        ("train_fsdp2.py", ["mixed_precision.fp32_master_weights=false"]),
        pytest.param("train_mfsdp.py", [], marks=needs_megatron_fsdp),
        # bf16 weights under Megatron-FSDP: its bf16 shards, bf16 gradients and CompensatedAdamW
        pytest.param("train_mfsdp.py", ["mixed_precision.fp32_master_weights=false"], marks=needs_megatron_fsdp),
    ],
)
def test_te_backend_learns_the_patterns_and_exports(tmp_path, images, script, overrides):
    train_on_gpu(script, tmp_path, images, TE, *overrides)
    assert best_accuracy(tmp_path) > 0.9, read_jsonl(tmp_path / "validation.jsonl")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gb"] > 0 and summary["median_mfu"] > 0
    assert summary["median_images_per_second_per_gpu"] > 0
    assert_export_holds_the_checkpoint(tmp_path, step=300)


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_layers_learn(tmp_path, images, recipe):
    """Every layer in FP8 (65 tokens per image: the model pads each sequence to 80 for the quantized GEMMs)."""
    train_on_gpu("train_ddp.py", tmp_path, images, TE, "fp8_config.enabled=true", f"fp8_config.fp8_recipe={recipe}")
    assert best_accuracy(tmp_path) > 0.85, read_jsonl(tmp_path / "validation.jsonl")
    assert_export_holds_the_checkpoint(tmp_path, step=300)


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
@needs_megatron_fsdp
@pytest.mark.parametrize(
    ("mesh", "micro_batch"),
    [("mfsdp.dp_replicate=1", 16), ("mfsdp.dp_replicate=2", 16), ("mfsdp.tp=2", 32)],
    ids=["fsdp", "hsdp", "tp"],
)
def test_megatron_fsdp_on_two_gpus_equals_one_gpu(tmp_path, images, mesh, micro_batch):
    """fsdp: both GPUs shard one model; hsdp: two replicas (dp_replicate=2); tp: each layer split over both GPUs,
    which then see the same 32 images. Every way, the losses are one GPU's, and so are validation and the export."""
    steps = ["num_train_steps=30", "validation.every_n_steps=30", "dataset.num_workers=0"]
    one = train_on_gpu("train_mfsdp.py", tmp_path / "one", images, TE, *steps, "dataset.micro_batch_size=32")
    two = train_on_gpu(
        "train_mfsdp.py", tmp_path / "two", images, TE, *steps, f"dataset.micro_batch_size={micro_batch}", mesh,
        nproc=2,
    )  # fmt: skip
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), (a, b)
    one_validation, two_validation = (read_jsonl(tmp_path / run / "validation.jsonl")[-1] for run in ("one", "two"))
    assert two_validation["images"] == one_validation["images"] == 100
    assert two_validation["loss"] == pytest.approx(one_validation["loss"], rel=5e-2)
    assert_export_holds_the_checkpoint(tmp_path / "two", step=30)


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_main_weights_start_from_the_float32_initialisation(tmp_path, images):
    """bf16 compute over fp32 main weights (the default): with lr 0, Megatron-FSDP's export, gathered from its main
    weights, holds DDP's float32 initialisation of the same seed exactly, not that initialisation rounded to bf16
    (what fully_shard builds its main weights from: the model is cast to bf16 before it)."""
    for script in ("train_mfsdp.py", "train_ddp.py"):
        run_script(
            script, f"output_dir={tmp_path / script}", f"dataset.path={images}", TE, *NO_LEARNING, nproc=1,
            cpu_only=False, timeout=600,
        )  # fmt: skip
    mfsdp, ddp = (load_export(tmp_path / s / "final_model").state_dict() for s in ("train_mfsdp.py", "train_ddp.py"))
    assert mfsdp.keys() == ddp.keys()
    for key, value in ddp.items():
        assert torch.equal(mfsdp[key], value), key
    # The test can tell: the weight matrices' random initialisation lies between bf16 values (biases start at 0).
    weights = [value for value in ddp.values() if value.dim() == 2 and value.numel() > 1000]
    assert all(not torch.equal(value, value.bfloat16().float()) for value in weights)


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("strategy", "overrides", "rtol"),
    [
        ("ddp", [], 1e-6),
        ("fsdp2", [], 1e-6),
        pytest.param("mfsdp", [], 1e-6, marks=needs_megatron_fsdp),  # its fp32 main weights
        pytest.param("mfsdp", ["mixed_precision.fp32_master_weights=false"], 1e-2, marks=needs_megatron_fsdp),
    ],
    ids=["ddp", "fsdp2", "mfsdp", "mfsdp-bf16-weights"],
)
def test_te_layers_decay_only_the_weight_matrices(tmp_path, strategy, overrides, rtol):
    """One step on zero gradients (tests/zero_gradient_step.py) with TE's layers, whose fused LayerNorm weights are
    among the undecayed: only the weight matrices shrink, by lr * weight_decay. Megatron-FSDP's fully_shard merges the
    optimizer's groups into one (every tensor decayed); model_setup splits them again."""
    result = zero_gradient_step(tmp_path, strategy, TE, *overrides, nproc=1, cpu_only=False)
    assert_strategy_decays_only_the_weight_matrices(result, rtol)


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_resumes_both_weight_decay_groups(tmp_path, images):
    """40 steps in one go vs 20 + resume + 20 under Megatron-FSDP, whose optimizer model_setup regroups after
    fully_shard: the checkpoint holds both groups' state and the resumed run logs the same losses (TE's deterministic
    attention backward; a lost moment would move step 22 by far more than the tolerance)."""
    deterministic = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    common = [f"dataset.path={images}", TE, "logger.log_every=1", "checkpoint.save_every=20"]
    for name, steps in (("full", 40), ("resumed", 20), ("resumed", 40)):
        args = [f"output_dir={tmp_path / name}", *common, f"num_train_steps={steps}"]
        result = run_script("train_mfsdp.py", *args, nproc=1, cpu_only=False, timeout=600, env=deterministic)
    assert "Resumed from" in result.stdout + result.stderr
    full, resumed = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("full", "resumed"))
    assert [m["step"] for m in resumed] == list(range(1, 41))
    torch.testing.assert_close([m["loss"] for m in resumed], [m["loss"] for m in full], rtol=0, atol=1e-4)


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_fsdp2_on_two_gpus_learns(tmp_path, images):
    train_on_gpu("train_fsdp2.py", tmp_path, images, TE, nproc=2)
    assert best_accuracy(tmp_path) > 0.9, read_jsonl(tmp_path / "validation.jsonl")
    assert_export_holds_the_checkpoint(tmp_path, step=300)


@pytest.mark.requires_te
@pytest.mark.parametrize(("config", "fp8"), [("vit_base", False), ("vit_base", True), ("vit_tiny", False)])
def test_224_pixel_configs_run_at_full_size(tmp_path_factory, config, fp8):
    """The shipped 224-pixel shapes, 10 steps on 224-pixel images (ViT-B/16: 197 tokens, padded to 208 in FP8)."""
    from make_sample_images import make_sample_images

    root = tmp_path_factory.mktemp("data224") / "images"
    make_sample_images(root, per_class=40, size=224)
    out = tmp_path_factory.mktemp("run")
    overrides = ["num_train_steps=10", "validation.every_n_steps=10", "dataset.micro_batch_size=32"]
    if fp8:
        overrides.append("fp8_config.enabled=true")
    script = "train_mfsdp.py" if importlib.util.find_spec("megatron_fsdp") else "train_fsdp2.py"
    args = ["--config-name", config, f"output_dir={out}", f"dataset.path={root}", *overrides]
    run_script(script, *args, nproc=1, cpu_only=False, timeout=600)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics[-1]["step"] == 10 and all(m["loss"] == m["loss"] for m in metrics)  # finite, no NaN
    assert (out / "final_model" / "model.safetensors").is_file()


two_gpus = pytest.mark.requires_multi_gpu


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "nproc"),
    [
        ("train_fsdp2.py", 1),
        pytest.param("train_mfsdp.py", 1, marks=needs_megatron_fsdp),
        # Two ranks: each copies its own rows of every full tensor into its shard (common/pretrained_weights.py).
        pytest.param("train_fsdp2.py", 2, marks=two_gpus),
        pytest.param("train_mfsdp.py", 2, marks=[needs_megatron_fsdp, two_gpus]),
    ],
    ids=["fsdp2", "mfsdp", "fsdp2-2gpu", "mfsdp-2gpu"],
)
def test_finetune_on_gpu_from_a_stock_checkpoint_and_from_its_export(
    tmp_path, images, stock_checkpoint, script, nproc
):
    """A stock ViT loaded into TE's layers on GPUs, sharded by FSDP2 or by Megatron-FSDP (into its fp32 main weights,
    after sharding; each rank loads its shard): with lr 0 the export holds the stock weights exactly, and the export
    loaded in its turn gives them again."""
    path, hf_model = stock_checkpoint
    expected = convert_vit_hf_to_te(hf_model, backend="torch").state_dict()
    source = path
    for run in ("from_stock", "from_export"):
        result = finetune(script, tmp_path / run, images, source, nproc=nproc, cpu_only=False)
        assert "te backend" in result.stdout + result.stderr
        assert_export_holds(tmp_path / run, expected)
        source = tmp_path / run / "final_model"


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
@needs_megatron_fsdp
def test_finetune_with_tensor_parallelism_starts_from_bf16_rounded_weights(tmp_path, images, stock_checkpoint):
    """``mfsdp.tp=2``: each GPU's share of every layer is cut from the whole model, so the pretrained weights are
    loaded before the bf16 cast and Megatron-FSDP's fp32 main weights start from them rounded to bf16 (the README
    says so and the log warns). With lr 0 the export, gathered from the two TP ranks, holds exactly that: every
    weight the stock checkpoint's rounded to bf16, none left at its initialisation."""
    path, hf_model = stock_checkpoint
    expected = convert_vit_hf_to_te(hf_model, backend="torch").state_dict()
    rounded = {key: value.to(torch.bfloat16).float() for key, value in expected.items() if value.is_floating_point()}
    result = finetune("train_mfsdp.py", tmp_path, images, path, "mfsdp.tp=2", nproc=2, cpu_only=False)
    assert "mfsdp.tp=2: Megatron-FSDP's fp32 main weights start from the pretrained weights rounded to bf16" in (
        result.stdout + result.stderr
    )
    assert_export_holds(tmp_path, rounded)
