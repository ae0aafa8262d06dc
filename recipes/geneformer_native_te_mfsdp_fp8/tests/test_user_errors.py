"""User errors end with one line that names the problem and the fix, exit status 2, no traceback, nothing lost.

Each case runs the script with the command line a user types and provokes one mistake: a missing data path (or
validation path), a parquet without the input_ids column, gene ids outside the vocabulary (found in the data), a
misspelled key, a value of the wrong type, FP8 or the TE backend on a machine without them, Megatron-FSDP without
GPUs, a tokenizer that does not fit the model, resuming a checkpoint with another model shape, fine-tuning from an
export with a file missing. The script runs as ``__main__`` inside the test process (a new interpreter would spend
~10 s importing torch for a run that fails in a second), except where the mistake is about the hardware: those runs
need a process whose GPUs are hidden.
"""

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from launch import assert_user_error, run_in_process, run_script, snapshot


FAST = ["dataset.max_seq_length=128", "dataset.token_budget=1024", "logger.log_every=1", "dataset.num_workers=0"]


def fail(script: str, tmp_path: Path, *overrides: str):
    return run_in_process(script, f"output_dir={tmp_path / 'run'}", *FAST, *overrides, expect_failure=True)


def fail_in_a_subprocess(script: str, tmp_path: Path, *overrides: str, nproc: int | None = None):
    """A new process with the GPUs hidden (a mistake about the hardware), or ``nproc`` ranks under torchrun."""
    args = [f"output_dir={tmp_path / 'run'}", *FAST, *overrides]
    return run_script(script, *args, expect_failure=True, cpu_only=True, nproc=nproc)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step DDP run: checkpoints/step_2, metrics.jsonl, summary.json and final_model/."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    run_script("train_ddp.py", f"output_dir={output_dir}", *FAST, "num_train_steps=2")
    assert (output_dir / "checkpoints" / "step_2").is_dir() and (output_dir / "final_model").is_dir()
    return output_dir


# ---------------------------------------------------------------------------------------------------- data


def test_missing_data_path(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.path=/no/such/cells.parquet")
    assert_user_error(result, "/no/such/cells.parquet")


def test_missing_validation_file_fails_before_training(tmp_path):
    result = fail("train_fsdp2.py", tmp_path, "validation.path=/no/such/held_out.parquet")
    assert_user_error(result, "'/no/such/held_out.parquet' matches no Parquet file", "point validation.path at")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not a single step trained


def test_parquet_without_the_input_ids_column(tmp_path):
    pq.write_table(pa.table({"genes": [[5, 6, 7]], "length": [3]}), tmp_path / "cells.parquet")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'cells.parquet'}")
    assert_user_error(result, "input_ids", "genes")


def test_gene_ids_outside_the_vocabulary(tmp_path):
    pq.write_table(pa.table({"input_ids": [[5, 6, 7], [8, 3000, 9]]}), tmp_path / "cells.parquet")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'cells.parquet'}")
    assert_user_error(result, "3000", "1024")  # L0_sanity's vocabulary


# ---------------------------------------------------------------------------------------------------- config


def test_misspelled_key(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.token_budjet=4")
    assert_user_error(result, "dataset.token_budjet is not a config key", "did you mean dataset.token_budget?")


def test_value_of_the_wrong_type(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.max_seq_length=long")
    assert_user_error(result, "dataset.max_seq_length=long is not an integer", "give dataset.max_seq_length")


def test_model_override_that_does_not_exist(tmp_path):
    result = fail("train_ddp.py", tmp_path, "++model_config_overrides.num_layers=3")
    assert_user_error(result, "model_config_overrides has keys ['num_layers']", "check their spelling")


def test_model_override_the_model_cannot_honour(tmp_path):
    result = fail("train_ddp.py", tmp_path, "++model_config_overrides.hidden_act=swish")
    assert_user_error(result, "hidden_act must be one of", "change model_config_overrides")


def test_fp8_on_a_machine_without_it(tmp_path):
    result = fail_in_a_subprocess("train_ddp.py", tmp_path, "fp8_config.enabled=true")
    assert_user_error(result, "fp8_config.enabled=false")


def test_fp8_with_a_shape_its_gemms_cannot_take(tmp_path):
    """Checked before the hardware, so it fails the same on every machine."""
    result = fail(
        "train_ddp.py", tmp_path, "fp8_config.enabled=true", "++model_config_overrides.intermediate_size=100"
    )
    assert_user_error(result, "multiples of 16, got intermediate_size 100", "change model_config_overrides")


def test_te_backend_on_a_machine_without_it(tmp_path):
    result = fail_in_a_subprocess("train_ddp.py", tmp_path, "++model_config_overrides.backend=te")
    assert_user_error(
        result, "backend='te' was requested but cannot run here", "+model_config_overrides.backend=torch"
    )


def test_megatron_fsdp_without_gpus(tmp_path):
    result = fail_in_a_subprocess("train_mfsdp.py", tmp_path)
    assert_user_error(result, "train_mfsdp.py needs CUDA GPUs", "use train_fsdp2.py")


def test_tokenizer_of_another_vocabulary(tmp_path):
    (tmp_path / "genes.json").write_text('{"<pad>": 0, "<mask>": 1, "ENSG00000141510": 2}')
    result = fail("train_ddp.py", tmp_path, f"tokenizer_path={tmp_path / 'genes.json'}")
    assert_user_error(result, "does not fit the model", "(3, 0, 1)", "(1024, 0, 1)")


# ---------------------------------------------------------------------------------------------------- resume, export


def test_resume_with_another_model_shape_keeps_the_run(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = snapshot(run)
    result = run_in_process(
        "train_ddp.py", f"output_dir={run}", *FAST, "num_train_steps=4", "++model_config_overrides.hidden_size=64",
        expect_failure=True,
    )  # fmt: skip
    assert_user_error(result, f"checkpoint {run}/checkpoints/step_2 holds a model of another shape", "new output_dir")
    assert snapshot(run) == before


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json"])
def test_finetune_from_an_export_with_a_file_missing(finished_run, tmp_path, missing):
    export = shutil.copytree(finished_run / "final_model", tmp_path / "final_model")
    (export / missing).unlink()
    result = fail("train_ddp.py", tmp_path, f"model_tag={export}", "init_from_pretrained=true")
    assert_user_error(result, f"model_tag={export} lacks {missing}", "export it again")
