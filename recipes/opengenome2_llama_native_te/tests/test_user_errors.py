"""User errors end with one line that names the problem and the fix, exit status 2, no traceback, nothing lost.

Each case runs the script with the command line a user types and provokes one mistake: a missing or empty data file,
a wrong column, a misspelled key, a value of the wrong type, FP8 on a machine without it, resuming a checkpoint with
another model shape, evaluating an export with a file missing. The script runs as ``__main__`` inside the test process
(a new interpreter would spend ~10 s importing torch for a run that fails in a second), except where the mistake is
about the hardware: those runs need a process whose GPUs are hidden.
"""

import json
import shutil
from pathlib import Path

from launch import assert_user_error, run_in_process, run_script, snapshot
from training import FAST


def fail(tmp_path: Path, *overrides: str):
    return run_in_process("train_fsdp2.py", f"output_dir={tmp_path / 'run'}", *FAST, *overrides, expect_failure=True)


def fail_in_a_subprocess(tmp_path: Path, *overrides: str):
    """A new process with the GPUs hidden: for a mistake about the hardware."""
    args = [f"output_dir={tmp_path / 'run'}", *FAST, *overrides]
    return run_script("train_fsdp2.py", *args, expect_failure=True, cpu_only=True)


# ---------------------------------------------------------------------------------------------------- data


def test_missing_data_path(tmp_path):
    result = fail(tmp_path, "dataset.path=/no/such/shards")
    assert_user_error(result, "dataset.path '/no/such/shards' does not exist", "point dataset.path at")


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = fail(tmp_path, f"dataset.path={tmp_path / 'empty.jsonl'}")
    assert_user_error(result, "empty.jsonl: no sequences (empty files?)", "point dataset.path at")


def test_wrong_column(tmp_path):
    (tmp_path / "genomes.jsonl").write_text(json.dumps({"sequence": "ACGT" * 100}) + "\n")
    result = fail(tmp_path, f"dataset.path={tmp_path / 'genomes.jsonl'}")
    assert_user_error(result, "genomes.jsonl:1: no string under key 'text'", "set dataset.sequence_column")


def test_file_that_is_not_parquet(tmp_path):
    (tmp_path / "shard.parquet").write_text("not parquet\n")
    result = fail(tmp_path, f"dataset.path={tmp_path / 'shard.parquet'}")
    assert_user_error(result, "shard.parquet: cannot be read as parquet")


# ---------------------------------------------------------------------------------------------------- config


def test_misspelled_key(tmp_path):
    result = fail(tmp_path, "validation.every_n_step=5")
    assert_user_error(result, "validation.every_n_step is not a config key", "did you mean validation.every_n_steps?")


def test_value_of_the_wrong_type(tmp_path):
    result = fail(tmp_path, "validation.every_n_steps=often")
    assert_user_error(result, "validation.every_n_steps=often is not an integer", "give validation.every_n_steps")


def test_fp8_on_a_machine_without_it(tmp_path):
    """CPU-only (TE missing, or TE without a GPU): the message says how to train without FP8."""
    result = fail_in_a_subprocess(tmp_path, "fp8_config.enabled=true")
    assert_user_error(result, "fp8_config.enabled=false")


def test_te_backend_on_a_machine_without_it(tmp_path):
    result = fail_in_a_subprocess(tmp_path, "+model_config_overrides.backend=te")
    assert_user_error(
        result, "backend='te' was requested but cannot run here", "+model_config_overrides.backend=torch"
    )


# ---------------------------------------------------------------------------------------------------- resume, export


def test_resume_with_another_model_shape_keeps_the_run(l0_run, tmp_path):
    run = shutil.copytree(l0_run, tmp_path / "run")
    before = snapshot(run)
    deeper = "+model_config_overrides.num_hidden_layers=3"
    result = run_in_process(
        "train_fsdp2.py", f"output_dir={run}", *FAST, "num_train_steps=70", deeper, expect_failure=True
    )
    assert_user_error(result, f"checkpoint {run}/checkpoints/step_60 holds a model of another shape", "new output_dir")
    assert snapshot(run) == before


def test_evaluate_an_export_with_a_file_missing(l0_run, tmp_path):
    export = shutil.copytree(l0_run / "final_model", tmp_path / "final_model")
    (export / "model.safetensors").unlink()
    fasta = tmp_path / "heldout.fasta"
    fasta.write_text(">s\nACGTACGTAC\n")
    result = run_in_process("scripts/evaluate_fasta_lm_loss.py", str(export), str(fasta), expect_failure=True)
    assert_user_error(result, f"checkpoint={export} lacks model.safetensors", "export it again")
