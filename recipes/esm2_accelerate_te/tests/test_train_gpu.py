"""train.py on GPUs through every shipped accelerate config (skipped on machines without them).

The 8M-parameter L0 sanity shapes (ESM-2 and AMPLIFY) train for 100 steps with the TransformerEngine backend; the
references are those of the CPU tests: loss below the residue background entropy, an export that loads and holds
the trained weights, FP8 that really ran (TE recorded FP8 amax values), and the native recipe's loss curve.
"""

import os
import re
from pathlib import Path

import pytest
import torch
from accelerate_run import accelerate_launch, read_metrics, read_summary
from conftest import NO_LEARNING, assert_export_holds, save_stock_esm2
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForMaskedLM


LOSS_THRESHOLD = 2.85


# TE's fused attention runs a deterministic backward only when asked to; GEMMs and norms are run-to-run exact. With it,
# two TE runs of the same steps log the same losses bit for bit.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def train_on_gpu(
    config_file: str,
    output_dir: Path,
    *overrides: str,
    num_processes: int = 1,
    steps: int = 100,
    env: dict | None = None,
):
    """--config-name (if any) must come first in ``overrides``: argparse takes no positional arguments after it."""
    schedule = [f"output_dir={output_dir}", f"num_train_steps={steps}", "logger.log_every=10"]
    config, rest = (
        (list(overrides[:2]), list(overrides[2:])) if overrides[:1] == ("--config-name",) else ([], overrides)
    )
    accelerate_launch(config_file, *config, *schedule, *rest, num_processes=num_processes, cpu_only=False, env=env)
    return read_metrics(output_dir)


def assert_learned(metrics: list[dict], last_steps: int = 20) -> None:
    final = [m["loss"] for m in metrics if m["step"] > metrics[-1]["step"] - last_steps]
    assert sum(final) / len(final) < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]


def assert_export_loads(output_dir: Path, step: int) -> None:
    """The export loads on the CPU without TE; where the checkpoint has plain safetensors (DDP), it holds its weights."""
    export_dir = output_dir / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    assert config.layer_precision is None
    model = AutoModelForMaskedLM.from_pretrained(export_dir, config=config, trust_remote_code=True).eval()
    weights = output_dir / f"checkpoint-{step}" / "model.safetensors"
    if weights.is_file():
        state = model.state_dict()
        for name, tensor in load_file(weights).items():
            if name.endswith("_extra_state"):  # TE's FP8 bookkeeping, not a weight
                continue
            torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=0, msg=name)
    logits = model(input_ids=torch.tensor([[0, 5, 6, 32, 7, 2]])).logits
    assert torch.isfinite(logits).all()


CASES = {
    "ddp-esm2-bshd": ("default.yaml", []),
    "ddp-esm2-thd": ("default.yaml", ["dataset.input_format=thd"]),
    "fsdp2-esm2-thd": ("fsdp2_te.yaml", ["dataset.input_format=thd"]),
    "fsdp2-amplify-thd": ("fsdp2_te.yaml", ["--config-name", "L0_sanity_amplify", "dataset.input_format=thd"]),
    "fsdp2-stock-hf": ("fsdp2_hf.yaml", ["model_implementation=hf"]),
}


def _cases(num_processes: int):
    marks = [pytest.mark.requires_te] + ([pytest.mark.requires_multi_gpu] if num_processes > 1 else [])
    return [
        pytest.param(*case, num_processes, id=f"{name}-{num_processes}gpu", marks=marks)
        for name, case in CASES.items()
    ]


@pytest.mark.parametrize(("config_file", "overrides", "num_processes"), _cases(1) + _cases(2))
def test_learns_and_exports(tmp_path, config_file, overrides, num_processes):
    metrics = train_on_gpu(config_file, tmp_path, *overrides, num_processes=num_processes)
    assert_learned(metrics)
    summary = read_summary(tmp_path)
    assert summary["world_size"] == num_processes and summary["median_mfu"] > 0 and summary["peak_memory_gb"] > 0
    assert summary["fp8_modules_with_amax"] == 0  # bf16 runs run no FP8 GEMM
    if "model_implementation=hf" in overrides:  # saved by transformers itself; loads without remote code
        export_dir = tmp_path / "final_model"
        assert AutoConfig.from_pretrained(export_dir).architectures == ["EsmForMaskedLM"]
        logits = AutoModelForMaskedLM.from_pretrained(export_dir)(input_ids=torch.tensor([[0, 5, 6, 32, 7, 2]])).logits
        assert torch.isfinite(logits).all()
    else:
        assert_export_loads(tmp_path, step=100)


def _fp8_cases():
    cases = []
    for config_file in ("fp8.yaml", "fp8_fsdp2.yaml"):
        for num_processes in (1, 2):
            marks = [pytest.mark.requires_fp8] + ([pytest.mark.requires_multi_gpu] if num_processes > 1 else [])
            cases.append(pytest.param(config_file, num_processes, id=f"{config_file}-{num_processes}gpu", marks=marks))
    return cases


@pytest.mark.parametrize(("config_file", "num_processes"), _fp8_cases())
def test_fp8_really_runs_and_learns(tmp_path, config_file, num_processes):
    """With mixed_precision: fp8 the transformer layers run FP8 GEMMs (TE recorded amax values in every FP8 module),
    not bf16 in disguise, and the model still learns. Both configs use DelayedScaling, so by default the launch's first
    micro-batch set the 4 quantized gradients' scales (QKV, proj, fc1, fc2) of all 6 layers on every process first."""
    schedule = [f"output_dir={tmp_path}", "num_train_steps=100", "logger.log_every=10", "dataset.input_format=thd"]
    result = accelerate_launch(config_file, *schedule, num_processes=num_processes, cpu_only=False)
    log = result.stdout + result.stderr
    calibrated = rf"DelayedScaling: [2-5] forward/backward passes .* set {24 * num_processes} gradient scales before"
    assert re.search(calibrated, log), log[-3000:]
    metrics = read_metrics(tmp_path)
    assert_learned(metrics)
    summary = read_summary(tmp_path)
    assert summary["fp8_requested"] is True
    # 6 layers x (LayerNormLinear QKV, Linear proj, LayerNormMLP) = 18 FP8 modules in the 8M ESM-2.
    assert summary["fp8_modules_with_amax"] >= 18, summary
    assert_export_loads(tmp_path, step=100)


@pytest.mark.requires_fp8
def test_fp8_on_chosen_layers_runs_fp8_only_there(tmp_path):
    """``fp8_layers=[2,3]`` with an FP8 launch: exactly the 3 FP8 modules of each of those 2 layers recorded amax
    values (6 of the 8M model's 18), the other layers ran bf16, and the model learns. Before step 1 the Trainer's
    first micro-batch set the scales of only those layers' 4 quantized gradients each (QKV, proj, fc1, fc2;
    fp8_calibration.py, on by default)."""
    schedule = [f"output_dir={tmp_path}", "num_train_steps=100", "logger.log_every=10"]
    result = accelerate_launch("fp8.yaml", *schedule, "dataset.input_format=thd", "fp8_layers=[2,3]", cpu_only=False)
    log = result.stdout + result.stderr
    calibrated = r"DelayedScaling: [2-5] forward/backward passes .* set 8 gradient scales before step 1"
    assert re.search(calibrated, log), log[-3000:]
    metrics = read_metrics(tmp_path)
    assert_learned(metrics)
    assert read_summary(tmp_path)["fp8_modules_with_amax"] == 6
    assert_export_loads(tmp_path, step=100)


@pytest.mark.requires_te
def test_fsdp2_sharded_checkpoint_resumes_exactly(tmp_path):
    """FSDP2 over the TE model (sharded checkpoints): stopped after step 15 and relaunched, the run logs the losses
    and gradient norms of one that never stopped (TE's deterministic attention backward), and exports."""
    common = ["dataset.input_format=thd", "logger.log_every=1"]
    whole = train_on_gpu("fsdp2_te.yaml", tmp_path / "whole", *common, steps=30, env=DETERMINISTIC)
    split = tmp_path / "split"
    train_on_gpu("fsdp2_te.yaml", split, *common, "stop_after_steps=15", steps=30, env=DETERMINISTIC)
    assert (split / "checkpoint-15" / "COMPLETE").is_file() and not (split / "final_model").exists()
    resumed = train_on_gpu("fsdp2_te.yaml", split, *common, steps=30, env=DETERMINISTIC)
    assert [m["step"] for m in resumed] == list(range(1, 31))
    for expected, logged in zip(whole, resumed):
        assert logged["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-7), expected["step"]
        assert logged["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), expected["step"]
    assert_export_loads(split, step=30)


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_fsdp2_resume_on_one_gpu_continues_a_two_gpu_run(tmp_path):
    """FSDP2 over the TE model, stopped after step 15 on 2 GPUs and relaunched on 1: the sharded checkpoint is
    re-sharded for one process (weights, optimizer, schedule), the data goes on with the rows of the epoch that
    neither process had read, and the run learns and exports. Restored, not restarted: the first resumed step's loss
    is near the 2-GPU run's last, not a fresh model's ln(33) = 3.5."""
    common = ["dataset.input_format=thd", "logger.log_every=1"]
    train_on_gpu("fsdp2_te.yaml", tmp_path, *common, "stop_after_steps=15", steps=30, num_processes=2)
    before = read_metrics(tmp_path)
    assert (tmp_path / "checkpoint-15" / "COMPLETE").is_file() and [m["step"] for m in before][-1] == 15
    schedule = [f"output_dir={tmp_path}", "num_train_steps=30", *common]
    result = accelerate_launch("fsdp2_te.yaml", *schedule, num_processes=1, cpu_only=False)
    log = result.stdout + result.stderr
    assert "written by 2 processes, this run has 1" in log and "dealt out to 1 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    last_two_gpu = sum(m["loss"] for m in before[-5:]) / 5
    assert metrics[15]["loss"] < last_two_gpu + 0.3 < 3.3, (last_two_gpu, metrics[15]["loss"])
    assert_export_loads(tmp_path, step=30)


@pytest.mark.requires_te
@pytest.mark.parametrize(
    "num_processes", [1, pytest.param(2, marks=pytest.mark.requires_multi_gpu)], ids=["1gpu", "2gpu"]
)
def test_fsdp2_fine_tuning_from_a_published_amplify_checkpoint(tmp_path, published_amplify, num_processes):
    """FSDP2 over the TE model, fine-tuning from a published-layout AMPLIFY checkpoint (converted on load, then
    sharded by accelerate): with lr 0 the export holds exactly the weights the checkpoint was written from, and so
    does a second fine-tuning from that export."""
    path, _, _, expected = published_amplify
    source = path
    for run in ("from_published", "from_export"):
        result = accelerate_launch(
            "fsdp2_te.yaml", f"output_dir={tmp_path / run}", f"model_tag={source}", "init_from_pretrained=true",
            "dataset.input_format=thd", *NO_LEARNING, num_processes=num_processes, cpu_only=False,
        )  # fmt: skip
        assert "Fine-tuning from the weights in" in result.stdout + result.stderr
        assert_export_holds(tmp_path / run, expected)
        source = tmp_path / run / "final_model"


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_fsdp2_fine_tuning_from_a_stock_esm2_checkpoint_on_two_gpus(tmp_path):
    """FSDP2 over the TE model on 2 GPUs, fine-tuning from a stock Hugging Face ESM-2 checkpoint: with lr 0 the
    export holds exactly the stock weights, converted to this recipe's names."""
    from convert import convert_esm_hf_to_te

    stock = save_stock_esm2(tmp_path / "stock")
    expected = {
        key: value
        for key, value in convert_esm_hf_to_te(stock, backend="torch").state_dict().items()
        if not key.endswith("_extra_state")
    }
    run = tmp_path / "run"
    accelerate_launch(
        "fsdp2_te.yaml", f"output_dir={run}", f"model_tag={tmp_path / 'stock'}", "init_from_pretrained=true",
        "dataset.input_format=thd", *NO_LEARNING, num_processes=2, cpu_only=False,
    )  # fmt: skip
    # Loaded the way a user loads it (the decoder weight is tied to the embeddings, so the file holds it once).
    config = AutoConfig.from_pretrained(run / "final_model", trust_remote_code=True, backend="torch")
    exported = AutoModelForMaskedLM.from_pretrained(run / "final_model", config=config, trust_remote_code=True)
    assert type(exported).__name__ == "NVEsmForMaskedLM"
    exported_state = exported.state_dict()
    for key, value in expected.items():
        assert torch.equal(exported_state[key], value), key


@pytest.mark.requires_te
def test_the_trainers_gradient_checkpointing_with_te_trains_the_same(tmp_path):
    """``+training_args.gradient_checkpointing=true`` with TE's layers (DDP, THD): every layer recomputed in backward
    through TE's checkpoint, the same losses and gradient norms as keeping activations (TE's deterministic attention
    backward), and a lower peak memory."""
    common = ["dataset.input_format=thd", "logger.log_every=1", "export_final_model=false"]
    plain = train_on_gpu("default.yaml", tmp_path / "plain", *common, steps=30, env=DETERMINISTIC)
    recompute = [*common, "+training_args.gradient_checkpointing=true"]
    recomputed = train_on_gpu("default.yaml", tmp_path / "recompute", *recompute, steps=30, env=DETERMINISTIC)
    assert [(m["loss"], m["grad_norm"]) for m in recomputed] == [(m["loss"], m["grad_norm"]) for m in plain]
    peak = {run: read_summary(tmp_path / run)["peak_memory_gb"] for run in ("plain", "recompute")}
    assert peak["recompute"] < peak["plain"], peak


@pytest.mark.requires_te
def test_torch_compile_through_the_trainer_learns_and_exports(tmp_path):
    """``+training_args.torch_compile=true`` (the Trainer compiles the model) with FSDP2 over the TE model."""
    metrics = train_on_gpu("fsdp2_te.yaml", tmp_path, "dataset.input_format=thd", "+training_args.torch_compile=true")
    assert_learned(metrics)
    assert_export_loads(tmp_path, step=100)


def _native_recipe() -> Path:
    return Path(__file__).resolve().parents[2] / "esm2_native_te"


@pytest.mark.requires_te
@pytest.mark.skipif(not _native_recipe().is_dir(), reason="recipes/esm2_native_te is not beside this recipe")
def test_fsdp2_loss_curve_matches_the_native_recipe(tmp_path):
    """Trainer + accelerate FSDP2 and the native train_fsdp2.py, same init (built on the GPU from the same seed), data
    and steps, bf16 with TE: the logged losses agree within bf16 noise (weight decay off: the Trainer exempts biases
    and norms from it)."""
    import subprocess
    import sys

    from launch import script_env

    common = ["num_train_steps=60", "logger.log_every=10", "adamw_kwargs.weight_decay=0.0", "dataset.input_format=thd"]
    common += ["export_final_model=false", "checkpoint.save_final=false"]
    accelerate_launch("fsdp2_te.yaml", f"output_dir={tmp_path / 'trainer'}", *common, cpu_only=False)
    native = _native_recipe()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_fsdp2.py"]
    command += [f"output_dir={tmp_path / 'native'}", *common, "fsdp.use_meta_device=false"]
    env = script_env(cpu_only=False)
    env["PYTHONPATH"] = os.pathsep.join([str(native), os.environ.get("PYTHONPATH", "")])  # not this recipe
    result = subprocess.run(command, cwd=native, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ours, theirs = read_metrics(tmp_path / "trainer"), read_metrics(tmp_path / "native")
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs)]
    assert max(differences) < 0.05, list(zip([m["loss"] for m in ours], [m["loss"] for m in theirs]))
