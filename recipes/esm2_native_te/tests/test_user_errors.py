"""User errors end with one line that names the problem and the fix, exit status 2, no traceback, nothing lost.

Each case runs the script with the command line a user types and provokes one mistake: a missing or empty data file
(or a missing held-out file), a wrong column, residues outside the alphabet (found in a data-loader worker), a
misspelled key, a value of the wrong type, FP8 on a machine without it, Megatron-FSDP without GPUs, resuming a
checkpoint with another model shape, fine-tuning from an export with a file missing. The script runs as ``__main__``
inside the test process (a new interpreter would spend ~10 s importing torch for a run that fails in a second), except
where the mistake is about the hardware: those runs need a process whose GPUs are hidden.
"""

import json
import shutil
from pathlib import Path

import pytest
from launch import assert_user_error, run_in_process, run_script, snapshot


TINY_MODEL = (
    "+model_config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 256, num_attention_heads: 4}"
)
FAST = ["dataset.max_seq_length=128", "dataset.micro_batch_size=16", "dataset.token_budget=2048", "logger.log_every=1"]


def fail(script: str, tmp_path: Path, *overrides: str):
    return run_in_process(script, f"output_dir={tmp_path / 'run'}", TINY_MODEL, *FAST, *overrides, expect_failure=True)


def fail_in_a_subprocess(script: str, tmp_path: Path, *overrides: str, nproc: int | None = None):
    """A new process with the GPUs hidden (a mistake about the hardware), or ``nproc`` ranks under torchrun."""
    args = [f"output_dir={tmp_path / 'run'}", TINY_MODEL, *FAST, *overrides]
    return run_script(script, *args, expect_failure=True, cpu_only=True, nproc=nproc)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step DDP run: checkpoints/step_2, metrics.jsonl, summary.json and final_model/."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    run_script("train_ddp.py", f"output_dir={output_dir}", TINY_MODEL, *FAST, "num_train_steps=2")
    assert (output_dir / "checkpoints" / "step_2").is_dir() and (output_dir / "final_model").is_dir()
    return output_dir


# ---------------------------------------------------------------------------------------------------- data


def test_missing_data_path(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.path=/no/such/proteins.parquet")
    assert_user_error(result, "'/no/such/proteins.parquet' matches no file", "point dataset.path at")


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.fasta").write_text("")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'empty.fasta'}")
    assert_user_error(result, "empty.fasta: no '>' header found (is the file empty?)")


def test_wrong_column(tmp_path):
    (tmp_path / "proteins.jsonl").write_text(json.dumps({"seq": "MKTAYIAKQR" * 4}) + "\n")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'proteins.jsonl'}")
    assert_user_error(result, "no column 'sequence'", "['seq']", "set dataset.sequence_column")


def test_residues_outside_the_alphabet_from_a_loader_worker(tmp_path):
    """The row is checked inside the data-loader worker (num_workers: 1): still one line, with the worker's message."""
    (tmp_path / "proteins.fasta").write_text(">p1\nMKTAYIAKQR\n>p2\nMKTA1YIAK#\n")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'proteins.fasta'}")
    assert_user_error(result, "are not residues of the tokenizer", "invalid_residue_policy")


def test_missing_validation_file_fails_before_training(tmp_path):
    result = fail("train_fsdp2.py", tmp_path, "validation.path=/no/such/held_out.fasta")
    assert_user_error(result, "'/no/such/held_out.fasta' matches no file", "point validation.path at")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not a single step trained


# ---------------------------------------------------------------------------------------------------- config


def test_misspelled_key(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.micro_batch_sise=4")
    assert_user_error(result, "dataset.micro_batch_sise is not a config key", "did you mean dataset.micro_batch_size?")


def test_context_parallelism_with_padded_batches(tmp_path):
    """train_cp.py needs packed (THD) input; with BSHD it says so at start instead of failing in the first forward."""
    result = fail("train_cp.py", tmp_path, "cp_size=2", "dataset.input_format=bshd")
    assert_user_error(result, "context parallelism (cp_size=2) needs dataset.input_format=thd, not bshd")


def test_value_of_the_wrong_type(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.max_seq_length=long")
    assert_user_error(result, "dataset.max_seq_length=long is not an integer", "give dataset.max_seq_length")


def test_fp8_on_a_machine_without_it(tmp_path):
    """CPU-only (TE missing, or TE without a GPU): the message says how to train without FP8."""
    result = fail_in_a_subprocess("train_ddp.py", tmp_path, "fp8_config.enabled=true")
    assert_user_error(result, "fp8_config.enabled=false")


def test_te_backend_on_a_machine_without_it(tmp_path):
    result = fail_in_a_subprocess("train_ddp.py", tmp_path, "+model_config_overrides.backend=te")
    assert_user_error(
        result, "backend='te' was requested but cannot run here", "+model_config_overrides.backend=torch"
    )


@pytest.mark.parametrize(
    ("override", "phrase"),
    [
        ("wandb.mode=onlin", "wandb.mode=onlin: choose online, offline or disabled"),
        ("profiler.enabled=true profiler.kind=nsight", "profiler.kind=nsight: choose torch, nsys or python"),
        ("profiler.enabled=true profiler.start_step=5 profiler.end_step=2", "set end_step >= start_step"),
    ],
)
def test_logging_and_profiler_settings(tmp_path, override, phrase):
    assert_user_error(fail("train_ddp.py", tmp_path, *override.split()), phrase)


def test_megatron_fsdp_without_gpus(tmp_path):
    result = fail_in_a_subprocess("train_mfsdp.py", tmp_path)
    assert_user_error(result, "train_mfsdp.py needs CUDA GPUs", "use train_fsdp2.py")


# ---------------------------------------------------------------------------------------------------- resume, export


def test_resume_with_another_model_shape_keeps_the_run(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = snapshot(run)
    wider = TINY_MODEL.replace("hidden_size: 64", "hidden_size: 128")
    result = run_in_process(
        "train_ddp.py", f"output_dir={run}", wider, *FAST, "num_train_steps=4", expect_failure=True
    )
    assert_user_error(result, f"checkpoint {run}/checkpoints/step_2 holds a model of another shape", "new output_dir")
    assert snapshot(run) == before


def test_a_fresh_start_over_an_earlier_runs_checkpoints_keeps_them(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = snapshot(run)
    result = run_in_process(
        "train_ddp.py", f"output_dir={run}", TINY_MODEL, *FAST, "checkpoint.resume=false", expect_failure=True
    )
    assert_user_error(
        result, f"checkpoint.resume=false, but {run}/checkpoints holds checkpoints of an earlier run", "new output_dir"
    )
    assert snapshot(run) == before


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json"])
def test_finetune_from_an_export_with_a_file_missing(finished_run, tmp_path, missing):
    export = shutil.copytree(finished_run / "final_model", tmp_path / "final_model")
    (export / missing).unlink()
    result = fail("train_ddp.py", tmp_path, f"model_tag={export}", "init_from_pretrained=true")
    assert_user_error(result, f"model_tag={export} lacks {missing}", "export it again")
