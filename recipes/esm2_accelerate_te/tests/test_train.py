"""End-to-end runs of train.py on CPU, launched with ``accelerate launch --config_file accelerate_config/cpu.yaml``.

References are independent of the code under test: the loss must fall below the amino-acid background entropy
(~2.9 nats, which needs context: scripts/make_sanity_dataset.py), an interrupted run must match an uninterrupted one
exactly, and the export must hold the weights of the last checkpoint.
"""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from accelerate_run import FAST, TINY_ESM2, accelerate_launch, read_metrics, read_summary, refusal_line
from conftest import MISSING_WEIGHT, NO_LEARNING, assert_export_holds, save_stock_esm2
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForMaskedLM


LOSS_THRESHOLD = 2.85  # below the residue background entropy: the model uses context
CONVERGE = [
    "num_train_steps=60",
    "adamw_kwargs.lr=3e-3",
    "lr_scheduler_kwargs.num_warmup_steps=10",
    "lr_scheduler_kwargs.num_decay_steps=50",
    "logger.log_every=10",
]
TINY_AMPLIFY = (
    "model_config_overrides={hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 192}"
)


@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("model", ["esm2", "amplify"])
def test_l0_learns(tmp_path, model, num_processes):
    """Both model families learn under the Trainer on 1 and 2 CPU processes (DDP over gloo), and the run writes
    metrics, summary, a complete checkpoint and an export."""
    config = ["--config-name", "L0_sanity"] if model == "esm2" else ["--config-name", "L0_sanity_amplify"]
    shape = TINY_ESM2 if model == "esm2" else TINY_AMPLIFY
    result = accelerate_launch(
        "cpu.yaml", *config, f"output_dir={tmp_path}", shape, *FAST, *CONVERGE, num_processes=num_processes
    )
    output = result.stdout + result.stderr
    assert "\r" not in output, "a progress bar wrote carriage returns into a log"
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [10, 20, 30, 40, 50, 60]
    assert metrics[-1]["loss"] < LOSS_THRESHOLD < metrics[0]["loss"] + 0.5, [m["loss"] for m in metrics]
    assert all(m["grad_norm"] > 0 for m in metrics)  # the Trainer's gradient norm reaches the metrics
    summary = read_summary(tmp_path)
    assert summary["world_size"] == num_processes and summary["steps"] == 60
    assert summary["fp8_requested"] is False and summary["fp8_modules_with_amax"] == 0
    assert (tmp_path / "checkpoint-60" / "COMPLETE").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoint-60" / "data_position").iterdir()) == [
        f"rank{r}.pt" for r in range(num_processes)
    ]
    assert (tmp_path / "final_model" / "config.json").is_file()


def test_resume_is_exact(tmp_path):
    """Stopped after step 6 and relaunched, a 2-process run logs the same losses as one that never stopped: model,
    optimizer, schedule, RNG and each process's data position all come back."""
    common = [TINY_ESM2, *FAST, "num_train_steps=12", "logger.log_every=1", "export_final_model=false"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    accelerate_launch("cpu.yaml", f"output_dir={whole}", *common, num_processes=2)
    accelerate_launch("cpu.yaml", f"output_dir={split}", *common, "stop_after_steps=6", num_processes=2)
    assert (split / "checkpoint-6" / "COMPLETE").is_file() and not (split / "checkpoint-12").exists()
    result = accelerate_launch("cpu.yaml", f"output_dir={split}", *common, num_processes=2)
    assert "Resuming from" in result.stdout + result.stderr
    expected = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(whole)]
    resumed = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(split)]
    assert [s for s, _, _ in resumed] == list(range(1, 13))
    for (step, loss, norm), (_, resumed_loss, resumed_norm) in zip(expected, resumed):
        assert resumed_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), step
        assert resumed_norm == pytest.approx(norm, rel=1e-5), step


def test_metrics_log_the_learning_rate_each_step_trained_with(tmp_path):
    """The Trainer steps the scheduler before ``on_step_end``; the logged rate is still the one the optimizer step
    used: 4 warm-up steps to 2e-3 train with 2e-3 * k / 4 at step k (scheduler.py), not one step ahead."""
    accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path}", TINY_ESM2, *FAST, "num_train_steps=4", "logger.log_every=1",
        "adamw_kwargs.lr=2e-3", "lr_scheduler_kwargs.num_warmup_steps=4", "export_final_model=false",
        "checkpoint.save_final=false",
    )  # fmt: skip
    assert [m["lr"] for m in read_metrics(tmp_path)] == pytest.approx([5e-4, 1e-3, 1.5e-3, 2e-3], rel=1e-6)


def test_a_resume_trains_with_the_learning_rate_of_its_config(tmp_path):
    """Resumed with a lower ``adamw_kwargs.lr`` (after a loss spike, say), the run trains with it from the resumed step
    on and says so: the checkpoint brings AdamW's moments and the schedule's step, not the old peak lr."""
    common = [
        TINY_ESM2, *FAST, "num_train_steps=4", "logger.log_every=1", "lr_scheduler_kwargs.num_warmup_steps=4",
        "export_final_model=false",
    ]  # fmt: skip
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *common, "adamw_kwargs.lr=2e-3", "stop_after_steps=2")
    result = accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *common, "adamw_kwargs.lr=1e-3")
    assert "peak lr 0.002 -> 0.001" in result.stdout + result.stderr
    assert [m["lr"] for m in read_metrics(tmp_path)] == pytest.approx([5e-4, 1e-3, 7.5e-4, 1e-3], rel=1e-6)


def test_a_launch_that_would_mix_two_runs_in_output_dir_is_refused(tmp_path):
    """An earlier run left complete checkpoint-4 and -6. Starting afresh there (checkpoint.resume=false) would have
    its checkpoints pruned as "oldest", outranked by the old -6 on the next resume, or written into the old run's
    directories; resuming the older -4 would overwrite and prune -6. Both stop before training with one line naming
    the directory and checkpoints, and leave every file of the earlier run as it was; a plain relaunch continues it."""
    common = [TINY_ESM2, *FAST, "checkpoint.save_every=2", "checkpoint.max_checkpoints=2", "logger.log_every=1"]
    common += ["export_final_model=false"]
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *common, "num_train_steps=6")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert {p.name for p in tmp_path.glob("checkpoint-*")} == {"checkpoint-4", "checkpoint-6"}

    afresh = accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path}", *common, "num_train_steps=4", "checkpoint.resume=false",
        "adamw_kwargs.lr=1e-4", expect_failure=True,
    )  # fmt: skip
    message = refusal_line(afresh)
    assert "checkpoint.resume=false" in message and str(tmp_path / "checkpoint-6") in message, message
    older = accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path}", *common, "num_train_steps=8",
        f"checkpoint.resume_from={tmp_path / 'checkpoint-4'}", expect_failure=True,
    )  # fmt: skip
    message = refusal_line(older)
    assert "checkpoint.resume_from=" in message and "holds checkpoint-6 (" in message, message
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before

    result = accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *common, "num_train_steps=8")
    assert f"Resuming from {tmp_path / 'checkpoint-6'}" in result.stdout + result.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 9))


def test_a_save_replaces_what_a_killed_save_left_in_its_directory(tmp_path):
    """An incomplete checkpoint-2 of an earlier 2-process launch (no marker, its data positions, a stray file) is no
    run to refuse; this run's save of step 2 replaces it whole: exactly this launch's data position beside the
    marker, nothing of the old save."""
    leftover = tmp_path / "checkpoint-2"
    (leftover / "data_position").mkdir(parents=True)
    for rank in (0, 1):
        torch.save({"old": rank}, leftover / "data_position" / f"rank{rank}.pt")
    (leftover / "stray_from_the_old_save.bin").write_bytes(b"old")
    accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path}", TINY_ESM2, *FAST, "num_train_steps=2", "export_final_model=false"
    )
    assert (leftover / "COMPLETE").is_file() and not (leftover / "stray_from_the_old_save.bin").exists()
    assert sorted(p.name for p in (leftover / "data_position").iterdir()) == ["rank0.pt"]
    assert "old" not in torch.load(leftover / "data_position" / "rank0.pt", weights_only=False)


def test_resume_on_one_process_continues_a_two_process_run(tmp_path):
    """Stopped after step 6 on 2 processes and relaunched on 1: the Trainer restores weights, optimizer and schedule,
    and the data goes on with the rows of the epoch that neither process had read (``restore_data_position``)."""
    common = [TINY_ESM2, *FAST, "num_train_steps=12", "logger.log_every=1", "export_final_model=false"]
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *common, "stop_after_steps=6", num_processes=2)
    result = accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *common, num_processes=1)
    log = result.stdout + result.stderr
    assert "written by 2 processes, this run has 1" in log and "dealt out to 1 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert all(math.isfinite(m["loss"]) for m in metrics)


def test_the_trainers_gradient_checkpointing_recomputes_and_trains_the_same(tmp_path):
    """``+training_args.gradient_checkpointing=true`` (the Trainer calls the model's ``gradient_checkpointing_enable``:
    every layer recomputed in backward) gives the same losses and gradient norms as keeping the activations."""
    common = [TINY_ESM2, *FAST, "num_train_steps=5", "logger.log_every=1", "export_final_model=false"]
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path / 'plain'}", *common)
    result = accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path / 'recompute'}", *common, "+training_args.gradient_checkpointing=true"
    )
    assert "recomputed in backward: every layer" in result.stdout + result.stderr
    plain = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "plain")]
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "recompute")] == plain


def test_export_loads_offline_and_holds_the_trained_weights(tmp_path):
    """final_model loads with AutoModelForMaskedLM (trust_remote_code, no network) and holds the weights of the
    last checkpoint, which the Trainer wrote with its own save_pretrained."""
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", TINY_ESM2, *FAST, "num_train_steps=5")
    export_dir = tmp_path / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    assert config.layer_precision is None and config.auto_map
    model = AutoModelForMaskedLM.from_pretrained(export_dir, config=config, trust_remote_code=True).eval()
    trained = load_file(tmp_path / "checkpoint-5" / "model.safetensors")
    state = model.state_dict()
    for name, tensor in trained.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    tokens = torch.tensor([[0, 5, 6, 32, 7, 2]])  # <cls> L A <mask> G <eos>
    logits = model(input_ids=tokens).logits
    assert logits.shape == (1, 6, 33) and torch.isfinite(logits).all()


def test_stock_hf_baseline_trains_and_exports(tmp_path):
    """model_implementation=hf trains transformers' own EsmForMaskedLM (the baseline) and exports it as such."""
    accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path}", TINY_ESM2, *FAST, "num_train_steps=5", "model_implementation=hf"
    )
    config = AutoConfig.from_pretrained(tmp_path / "final_model")
    assert config.model_type == "esm" and config.architectures == ["EsmForMaskedLM"]
    assert read_summary(tmp_path)["steps"] == 5


def test_fine_tuning_starts_from_a_stock_checkpoint(tmp_path):
    """init_from_pretrained=true loads a stock Hugging Face ESM-2 checkpoint into this recipe's model (converted):
    with lr 0 the export computes exactly what the stock model computes (float32, CPU)."""
    stock = save_stock_esm2(tmp_path / "stock")
    run = tmp_path / "run"
    accelerate_launch(
        "cpu.yaml", f"output_dir={run}", f"model_tag={tmp_path / 'stock'}", "init_from_pretrained=true",
        "adamw_kwargs.lr=0.0", "lr_scheduler_kwargs.num_warmup_steps=0", *FAST, "num_train_steps=2",
    )  # fmt: skip
    config = AutoConfig.from_pretrained(run / "final_model", trust_remote_code=True, backend="torch")
    exported = AutoModelForMaskedLM.from_pretrained(run / "final_model", config=config, trust_remote_code=True)
    tokens = torch.tensor([[0, 5, 6, 32, 7, 9, 2]])  # <cls> L A <mask> G ... <eos>
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(input_ids=tokens).logits, stock(input_ids=tokens).logits)


def test_fine_tuning_starts_from_a_published_amplify_checkpoint(tmp_path, published_amplify):
    """init_from_pretrained=true converts a published AMPLIFY checkpoint on load: with lr 0 the export holds exactly
    the weights the checkpoint was written from; and that export (an NVAmplify directory) is a model_tag to fine-tune
    from in its turn, giving the same weights again."""
    path, _, _, expected = published_amplify
    first = tmp_path / "from_published"
    result = accelerate_launch(
        "cpu.yaml", f"output_dir={first}", f"model_tag={path}", "init_from_pretrained=true", *FAST, *NO_LEARNING
    )
    assert "Fine-tuning from the weights in" in result.stdout + result.stderr
    assert [m["step"] for m in read_metrics(first)][-1] == 2
    assert_export_holds(first, expected)

    second = tmp_path / "from_export"
    accelerate_launch(
        "cpu.yaml", f"output_dir={second}", f"model_tag={first / 'final_model'}", "init_from_pretrained=true", *FAST,
        *NO_LEARNING,
    )  # fmt: skip
    assert_export_holds(second, expected)


def test_published_amplify_checkpoint_with_a_missing_weight_names_it(tmp_path, published_amplify):
    """A published checkpoint without one of its weights fails at start, in one line naming the weight, before any
    checkpoint (or export) is written."""
    _, state_dict, config, _ = published_amplify
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({k: v for k, v in state_dict.items() if k != MISSING_WEIGHT}, broken / "model.safetensors")
    (broken / "config.json").write_text(json.dumps(config))
    run = tmp_path / "run"
    result = accelerate_launch(
        "cpu.yaml", f"output_dir={run}", f"model_tag={broken}", "init_from_pretrained=true", *FAST, *NO_LEARNING,
        expect_failure=True,
    )  # fmt: skip
    # train.py says it in one line and exits with 2 (a user error); the launcher above it reports that with its own
    # traceback and exit status 1, which is accelerate's, not the recipe's.
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"missing keys ['{MISSING_WEIGHT}']" in errors[0] and str(broken) in errors[0], errors[0]
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]
    assert 'train.py", line' not in result.stderr, result.stderr[-3000:]  # no traceback from the recipe
    assert not list(run.glob("checkpoint-*")) and not (run / "final_model").exists()


def _native_recipe() -> Path:
    return Path(__file__).resolve().parents[2] / "esm2_native_te"


@pytest.mark.skipif(not _native_recipe().is_dir(), reason="recipes/esm2_native_te is not beside this recipe")
def test_same_losses_as_the_native_recipe(tmp_path):
    """The Trainer path and recipes/esm2_native_te's train_ddp.py give the same loss curve on the same data, init and
    steps (float32 on CPU; weight decay off, since the Trainer exempts biases and norms from it)."""
    import subprocess
    import sys

    from launch import script_env

    common = [TINY_ESM2, *FAST, "num_train_steps=15", "logger.log_every=1", "adamw_kwargs.weight_decay=0.0"]
    common += ["export_final_model=false", "checkpoint.save_final=false"]
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path / 'trainer'}", *common)
    native = _native_recipe()
    command = [sys.executable, "train_ddp.py", f"output_dir={tmp_path / 'native'}", *common]
    env = script_env()
    env["PYTHONPATH"] = os.pathsep.join([str(native), os.environ.get("PYTHONPATH", "")])  # not this recipe
    result = subprocess.run(command, cwd=native, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trainer, reference = read_metrics(tmp_path / "trainer"), read_metrics(tmp_path / "native")
    assert [m["step"] for m in trainer] == [m["step"] for m in reference] == list(range(1, 16))
    for ours, theirs in zip(trainer, reference):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3), ours["step"]


def test_fsdp_on_a_cpu_machine_fails_at_start_in_one_line(tmp_path):
    result = accelerate_launch("fsdp2_te.yaml", f"output_dir={tmp_path}", expect_failure=True)
    assert "error: the accelerate config asks for FSDP, which needs GPUs here" in result.stdout + result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_fp8_on_a_cpu_machine_fails_at_start(tmp_path):
    """accelerate launch itself refuses fp8 without TransformerEngine; started another way, train.py refuses it."""
    result = accelerate_launch("fp8.yaml", f"output_dir={tmp_path}", expect_failure=True)
    assert "FP8 is not available on this machine" in result.stderr
    from launch import run_script

    result = run_script(
        "train.py", f"output_dir={tmp_path}", env={"ACCELERATE_MIXED_PRECISION": "fp8"}, expect_failure=True
    )
    assert "error: mixed_precision: fp8 needs an NVIDIA GPU" in result.stdout + result.stderr
