"""The training scripts on a GPU with the TransformerEngine backend (skipped on machines without them).

The L0 sanity model trains for 100 steps; the references are the same as on CPU: the loss must fall well below the
masked genes' unigram entropy, the export must reproduce the checkpointed weights, and the held-out loss logged at
steps 50 and 100 must fall below that entropy too and (bf16) equal the export's evaluated on CPU to bf16 precision.
Megatron-FSDP, the recipe's main entrypoint, runs here with bf16 and with FP8; the benchmark configs run a few steps
at full size.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from convert import convert_geneformer_hf_to_te
from launch import run_script
from test_finetune import FINETUNE, assert_export_holds
from test_train import (
    LOSS_THRESHOLD,
    assert_export_reproduces_checkpoint,
    assert_same_as_one_larger_batch,
    assert_validation_is_the_exports_held_out_loss,
    load_export,
    read_metrics,
    validation_records,
)
from test_weight_decay import LR, WEIGHT_DECAY, assert_decayed_once, assert_logged_groups, one_decay_step


needs_megatron_fsdp = pytest.mark.skipif(
    importlib.util.find_spec("megatron_fsdp") is None, reason="megatron-fsdp is not installed"
)
FP8 = ["fp8_config.enabled=true", "dataset.pad_to_multiple_of=16"]
# L0_sanity's batching and its held-out cells, scored at steps 50 and 100 (VALIDATE) instead of 75, so that the last
# record is the exported model's.
L0_BATCHING = {"max_seq_length": 512, "micro_batch_size": 48, "token_budget": 2048}
VALIDATE = "validation.every_n_steps=50"
# TE's fused attention runs a deterministic backward only when asked to; GEMMs and norms are run-to-run exact. With it,
# two TE runs of the same steps log the same losses bit for bit, which the exactness tests below rely on.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
TE = "++model_config_overrides.backend=te"


def assert_validated(output_dir: Path, steps: list[int]) -> None:
    """validation.jsonl holds ``steps`` and the held-out loss fell below the unigram entropy by more than a nat (FP8
    runs: their evaluation is not compared with the export's in float32)."""
    records = validation_records(output_dir)
    assert [r["step"] for r in records] == steps
    assert records[-1]["val_loss"] < min(records[0]["val_loss"], LOSS_THRESHOLD), records


def train_on_gpu(
    script: str,
    output_dir: Path,
    *overrides: str,
    nproc: int | None = 1,
    steps: int = 100,
    config: str | None = None,
    env: dict | None = None,
) -> list:
    """``steps`` steps, logged every 10, with a checkpoint halfway (the export is compared with the last one)."""
    # Hydra's --config-name goes before the overrides: argparse takes no positional arguments after an option.
    config_name = ["--config-name", config] if config else []
    schedule = [f"num_train_steps={steps}", "logger.log_every=10", f"checkpoint.save_every={steps // 2}"]
    args = [*config_name, f"output_dir={output_dir}", *schedule, *overrides]
    run_script(script, *args, nproc=nproc, cpu_only=False, timeout=600, env=env)
    return read_metrics(output_dir)


def assert_learned(metrics: list[dict], threshold: float = LOSS_THRESHOLD, last_steps: int = 20) -> None:
    final = [m["loss"] for m in metrics if m["step"] > metrics[-1]["step"] - last_steps]
    assert sum(final) / len(final) < threshold, [round(m["loss"], 3) for m in metrics]


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", ["dataset.input_format=bshd"]),
        ("train_fsdp2.py", ["dataset.input_format=thd"]),
        # bf16 weights, sharded: CompensatedAdamW's Triton kernel updates each local shard.
        ("train_fsdp2.py", ["dataset.input_format=thd", "mixed_precision.fp32_master_weights=false"]),
        pytest.param("train_mfsdp.py", ["dataset.input_format=thd"], marks=needs_megatron_fsdp),
        # bf16 weights under Megatron-FSDP: its bf16 shards, bf16 gradients and CompensatedAdamW
        pytest.param(
            "train_mfsdp.py",
            ["dataset.input_format=thd", "mixed_precision.fp32_master_weights=false"],
            marks=needs_megatron_fsdp,
        ),
    ],
)
def test_te_backend_learns_and_exports(tmp_path, script, overrides):
    metrics = train_on_gpu(script, tmp_path, "++model_config_overrides.backend=te", VALIDATE, *overrides)
    assert_learned(metrics)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gb"] > 0 and summary["median_mfu"] > 0
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    input_format = next(o.split("=")[1] for o in overrides if o.startswith("dataset.input_format="))
    assert_validation_is_the_exports_held_out_loss(tmp_path, [50, 100], L0_BATCHING, input_format, rel=0.02)


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_layers_learn_with_megatron_fsdp(tmp_path, recipe):
    if importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    metrics = train_on_gpu("train_mfsdp.py", tmp_path, *FP8, f"fp8_config.fp8_recipe={recipe}", VALIDATE)
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated(tmp_path, [50, 100])


def assert_same_run(first: Path, second: Path) -> None:
    """Two runs' logged losses, gradient norms and held-out losses bit for bit, and their exported weights."""
    metrics = [read_metrics(first), read_metrics(second)]
    assert [m["step"] for m in metrics[1]] == [m["step"] for m in metrics[0]]
    assert [m["loss"] for m in metrics[1]] == [m["loss"] for m in metrics[0]]
    assert [m["grad_norm"] for m in metrics[1]] == [m["grad_norm"] for m in metrics[0]]
    assert validation_records(second) == validation_records(first) and validation_records(first)
    expected = load_export(first).state_dict()
    for name, value in load_export(second).state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_stop_and_go_matches_uninterrupted_run(tmp_path):
    """Megatron-FSDP (the recipe's main entrypoint) with TE layers in bf16 over its fp32 main weights, THD, dropout
    on, two micro-batches a step, asynchronous saves: 60 steps in one go and 30 + resume + 30 log the same losses,
    gradient norms and held-out losses bit for bit and export the same weights. So a checkpoint restores the fp32
    main weights (not the bf16 compute weights they are rounded to), the AdamW moments and step count, the schedule,
    the data position and the dropout RNG."""
    common = [
        "++model_config_overrides.backend=te",
        "dataset.input_format=thd",
        "grad_acc_steps=2",
        "checkpoint.async_save=true",
        "logger.log_every=1",
        "validation.every_n_steps=20",
    ]
    train_on_gpu("train_mfsdp.py", tmp_path / "full", *common, steps=60, env=DETERMINISTIC)
    train_on_gpu("train_mfsdp.py", tmp_path / "resumed", *common, "num_train_steps=30", steps=60, env=DETERMINISTIC)
    train_on_gpu("train_mfsdp.py", tmp_path / "resumed", *common, steps=60, env=DETERMINISTIC)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 61))
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides", "rtol"),
    [
        ("train_ddp.py", [], 1e-6),
        ("train_fsdp2.py", [], 1e-6),
        pytest.param("train_mfsdp.py", [], 1e-6, marks=needs_megatron_fsdp),  # its fp32 main weights
        pytest.param("train_mfsdp.py", ["mixed_precision.fp32_master_weights=false"], 1e-2, marks=needs_megatron_fsdp),
    ],
    ids=["ddp", "fsdp2", "mfsdp", "mfsdp-bf16-weights"],
)
def test_te_layers_decay_only_the_weight_matrices(tmp_path, script, overrides, rtol):
    """One step of a stock checkpoint fine-tuned in which only weight decay moves a weight (tests/test_weight_decay.py,
    ``ONLY_DECAY``), with TE's layers, whose fused LayerNorm weights are among the undecayed: only the weight matrices
    and embedding tables shrink, by lr * weight_decay. Megatron-FSDP's fully_shard merges the optimizer's groups into
    one (every tensor decayed); model_setup splits them again. With bf16 weights the loaded weights are the stock ones
    rounded to bf16."""
    before, after, log = one_decay_step(tmp_path, script, TE, *overrides, nproc=1, cpu_only=False)
    if "mixed_precision.fp32_master_weights=false" in overrides:
        before = {key: value.bfloat16().float() for key, value in before.items()}
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY, rtol=rtol, atol=1e-9)
    assert_logged_groups(log)


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_resumes_both_weight_decay_groups(tmp_path):
    """40 steps in one go vs 20 + resume + 20 under Megatron-FSDP, whose optimizer model_setup regroups after
    fully_shard, with a weight decay of 0.1 (100 times the default, so that a group lost, merged or swapped on resume
    would move the losses): the checkpoint holds both groups' state, and the resumed run logs the same losses,
    gradient norms and held-out losses bit for bit and exports the same weights (TE's deterministic attention
    backward)."""
    common = [TE, "dataset.input_format=thd", "logger.log_every=1", "validation.every_n_steps=20"]
    common += ["adamw_kwargs.weight_decay=0.1"]
    train_on_gpu("train_mfsdp.py", tmp_path / "full", *common, steps=40, env=DETERMINISTIC)
    train_on_gpu("train_mfsdp.py", tmp_path / "resumed", *common, "num_train_steps=20", steps=40, env=DETERMINISTIC)
    train_on_gpu("train_mfsdp.py", tmp_path / "resumed", *common, steps=40, env=DETERMINISTIC)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 41))  # 21-40 by the resumed run
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


@pytest.mark.requires_gpu
@needs_megatron_fsdp
def test_megatron_fsdp_grad_accumulation_equals_one_larger_batch(tmp_path):
    """grad_acc_steps=2 x 24 cells == 1 x 48 on one GPU in float32 (torch backend, dropout off; PyTorch's default
    keeps TF32 off): Megatron-FSDP sums the micro-batches' gradients in its main-gradient buffer and the token weights
    make the sum one batch's gradient. The same losses, gradient norms and exported weights, to float32 rounding."""
    common = [
        "++model_config_overrides.backend=torch",
        "mixed_precision.enabled=false",
        "dataset.input_format=bshd",
        "adamw_kwargs.eps=1e-3",  # Adam divides by sqrt(v) + eps: keep float noise in tiny gradients from flipping signs
        "logger.log_every=1",
        "++model_config_overrides.hidden_dropout_prob=0.0",
        "++model_config_overrides.attention_probs_dropout_prob=0.0",
    ]
    train_on_gpu(
        "train_mfsdp.py", tmp_path / "acc", *common, "dataset.micro_batch_size=24", "grad_acc_steps=2", steps=4
    )
    train_on_gpu(
        "train_mfsdp.py", tmp_path / "big", *common, "dataset.micro_batch_size=48", "grad_acc_steps=1", steps=4
    )
    assert_same_as_one_larger_batch(tmp_path / "acc", tmp_path / "big")


@pytest.mark.requires_te
@pytest.mark.parametrize(
    "script", ["train_ddp.py", "train_fsdp2.py", pytest.param("train_mfsdp.py", marks=needs_megatron_fsdp)]
)
def test_activation_recompute_trains_exactly_like_keeping_activations(tmp_path, script):
    """Both layers recomputed in backward (TE, bf16, THD, dropout on: the recompute draws the same masks), inside
    FSDP2's and Megatron-FSDP's gather/release hooks too: the same losses, gradient norms and held-out losses as
    keeping the activations, bit for bit, and a lower peak memory."""
    common = ["++model_config_overrides.backend=te", "dataset.input_format=thd", "logger.log_every=1"]
    common += ["validation.every_n_steps=15"]
    train_on_gpu(script, tmp_path / "plain", *common, steps=30, env=DETERMINISTIC)
    recompute = [*common, "+model_config_overrides.recompute_layers=2"]
    train_on_gpu(script, tmp_path / "recompute", *recompute, steps=30, env=DETERMINISTIC)
    assert_same_run(tmp_path / "plain", tmp_path / "recompute")
    peak = {
        run: json.loads((tmp_path / run / "summary.json").read_text())["peak_memory_gb"]
        for run in ("plain", "recompute")
    }
    assert peak["recompute"] < peak["plain"], peak


@pytest.mark.requires_fp8
def test_fp8_with_bshd_input_and_bf16_first_last_layers(tmp_path):
    overrides = ["dataset.input_format=bshd", "fp8_config.enabled=true", "fp8_config.fp8_recipe=Float8CurrentScaling"]
    overrides += ["++model_config_overrides.num_hidden_layers=4", "fp8_config.keep_first_last_bf16=1"]
    assert_learned(train_on_gpu("train_ddp.py", tmp_path, *overrides, VALIDATE))
    assert_export_reproduces_checkpoint(tmp_path, step=100)
    assert_validated(tmp_path, [50, 100])


@pytest.mark.requires_fp8
@pytest.mark.parametrize(("config", "fp8"), [("10m", True), ("106m", False), ("106m", True)])
def test_benchmark_configs_run_at_full_size(tmp_path, config, fp8):
    """A few steps of the full-size shape on the synthetic cells (2,048-gene budget), to the final export, with a
    held-out pass at the last step."""
    if importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    overrides = [
        "dataset.path=data/sanity_cells.parquet",
        "validation.path=data/sanity_cells_val.parquet",
        "validation.every_n_steps=10",
        "lr_scheduler_kwargs.num_warmup_steps=2",
        "logger.log_every=1",
    ]
    overrides += FP8 if fp8 else []
    metrics = train_on_gpu("train_mfsdp.py", tmp_path, *overrides, steps=10, config=config)
    assert metrics[-1]["step"] == 10 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (tmp_path / "final_model" / "model.safetensors").is_file()
    assert [r["step"] for r in validation_records(tmp_path)] == [10]


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
def test_finetune_on_gpu_from_a_stock_checkpoint_and_from_its_export(tmp_path, stock_checkpoint, script, nproc):
    """A stock Geneformer checkpoint loaded into TE's layers on GPUs, sharded by FSDP2 or by Megatron-FSDP (into its
    fp32 main weights; each rank loads its shard): with lr 0 the export holds the stock weights exactly, and the
    export loaded in its turn gives them again. (DDP loads the whole model as on the CPU.)"""
    path, hf_model = stock_checkpoint
    expected = convert_geneformer_hf_to_te(hf_model, backend="torch").state_dict()
    source = path
    for run in ("from_stock", "from_export"):
        result = run_script(
            script, *FINETUNE, f"output_dir={tmp_path / run}", f"model_tag={source}", "init_from_pretrained=true",
            "+model_config_overrides.backend=te", nproc=nproc, cpu_only=False, timeout=600,
        )  # fmt: skip
        assert "te backend" in result.stdout + result.stderr
        assert_export_holds(tmp_path / run, expected)
        source = tmp_path / run / "final_model"


@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_main_weights_start_from_the_float32_initialisation(tmp_path):
    """bf16 compute over fp32 main weights (the default; TE layers): with lr 0, Megatron-FSDP's export, gathered from
    its main weights, holds DDP's float32 initialisation of the same seed exactly, not that initialisation rounded to
    bf16 (what fully_shard builds its main weights from: the model is cast to bf16 before it)."""
    for script in ("train_mfsdp.py", "train_ddp.py"):
        run_script(
            script, *FINETUNE, f"output_dir={tmp_path / script}", "+model_config_overrides.backend=te", nproc=1,
            cpu_only=False, timeout=600,
        )  # fmt: skip
    mfsdp, ddp = (load_export(tmp_path / script).state_dict() for script in ("train_mfsdp.py", "train_ddp.py"))
    assert mfsdp.keys() == ddp.keys()
    for key, value in ddp.items():
        assert torch.equal(mfsdp[key], value), key
    # The test can tell: the weight matrices' random initialisation lies between bf16 values (biases start at 0).
    weights = [value for value in ddp.values() if value.dim() == 2 and value.numel() > 1000]
    assert all(not torch.equal(value, value.bfloat16().float()) for value in weights)


@pytest.mark.requires_multi_gpu
@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py", "train_mfsdp.py"])
def test_two_gpus_learn(tmp_path, script):
    if script == "train_mfsdp.py" and importlib.util.find_spec("megatron_fsdp") is None:
        pytest.skip("megatron-fsdp is not installed")
    assert_learned(train_on_gpu(script, tmp_path, "dataset.input_format=thd", VALIDATE, nproc=2))
    if script == "train_mfsdp.py":  # the sharded checkpoint and the gathered export, written by two ranks
        assert_export_reproduces_checkpoint(tmp_path, step=100)
    # The held-out cells split over the two GPUs: together, what one CPU process computes for the export.
    assert_validation_is_the_exports_held_out_loss(tmp_path, [50, 100], L0_BATCHING, "thd", rel=0.02)


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
@needs_megatron_fsdp
def test_megatron_fsdp_resume_on_two_gpus_continues_a_one_gpu_run(tmp_path):
    """Megatron-FSDP, packed cells: 50 steps on 1 GPU, then the same command on 2 GPUs resumes them (its checkpoint
    re-sharded over two ranks: fp32 main weights, AdamW moments, schedule), deals the epoch's unread cells out to both
    ranks, trains to 100 and exports the final checkpoint's weights, gathered from the two ranks. Restored, not
    restarted: the first resumed step's loss is the 1-GPU run's, not a fresh model's."""
    common = ["+model_config_overrides.backend=te", "dataset.input_format=thd", "logger.log_every=1"]
    train_on_gpu("train_mfsdp.py", tmp_path, *common, "num_train_steps=50", nproc=1)
    before = read_metrics(tmp_path)
    args = [f"output_dir={tmp_path}", "num_train_steps=100", "checkpoint.save_every=50", *common]
    result = run_script("train_mfsdp.py", *args, nproc=2, cpu_only=False, timeout=600)
    log = result.stdout + result.stderr
    assert "was written by 1 ranks, this run has 2" in log
    assert "1 DP ranks had read" in log and "dealt out to 2 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 101))
    last_one_gpu = sum(m["loss"] for m in before[-5:]) / 5
    assert metrics[50]["loss"] < last_one_gpu + 0.5 < before[0]["loss"], (before[0]["loss"], last_one_gpu, metrics[50])
    assert_learned(metrics)
    assert_export_reproduces_checkpoint(tmp_path, step=100)
