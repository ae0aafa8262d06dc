"""User errors end with one line that names the problem and the fix, exit status 2, no traceback, nothing lost.

Each case runs the script with the command line a user types and provokes one mistake: a missing or empty data file,
a missing validation file or a validation schedule of 0 steps, a wrong column, a misspelled key, a value of the wrong
type, an unknown config, FP8 on a machine without it, a cp_size that does not divide the world size, resuming a
checkpoint with another model shape or strategy, an export with a file missing. ``HYDRA_FULL_ERROR=1`` brings the
traceback back. The script runs as ``__main__`` inside the test process (a new interpreter would spend ~10 s importing
torch for a run that fails in a second), except where the mistake is about the hardware (those runs need a process
whose GPUs are hidden) or needs torchrun.
"""

import json
import shutil
from pathlib import Path

import pytest
from launch import RECIPE_DIR, assert_user_error, run_in_process, run_script, snapshot
from omegaconf import OmegaConf
from user_errors import PathNotFoundError


FAST = ["dataset.max_seq_length=128", "dataset.window_overlap=0", "dataset.token_budget=256", "logger.log_every=1"]


def fail(script: str, tmp_path: Path, *overrides: str, env: dict | None = None):
    args = [f"output_dir={tmp_path / 'run'}", *FAST, *overrides]
    return run_in_process(script, *args, env=env, expect_failure=True)


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
    result = fail("train_ddp.py", tmp_path, "dataset.path=/no/such/genome.fasta")
    assert_user_error(result, "dataset.path='/no/such/genome.fasta'", "no such file", "point dataset.path at")


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.fasta").write_text("")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'empty.fasta'}")
    assert_user_error(result, "empty.fasta' holds no sequences")


def test_wrong_column(tmp_path):
    (tmp_path / "genomes.jsonl").write_text(json.dumps({"seq": "ACGT" * 40}) + "\n")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'genomes.jsonl'}")
    assert_user_error(result, "genomes.jsonl:1 has no key 'sequence'", "set dataset.sequence_column")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "genomes.jsonl").write_text(json.dumps({"sequence": "ACGT" * 40}) + "\n{oops\n")
    result = fail("train_ddp.py", tmp_path, f"dataset.path={tmp_path / 'genomes.jsonl'}")
    assert_user_error(result, "genomes.jsonl:2: not a JSON object")


def test_missing_validation_path(tmp_path):
    """Found when the run starts, not at the first evaluation, and named by its own key."""
    result = fail("train_ddp.py", tmp_path, "validation.path=/no/such.fasta")
    last = assert_user_error(result, "validation.path='/no/such.fasta'", "no such file", "point validation.path at")
    assert "dataset.path" not in last
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_validation_every_zero_steps(tmp_path):
    result = fail("train_ddp.py", tmp_path, "validation.every_n_steps=0")
    assert_user_error(result, "validation.every_n_steps must be >= 1 when validation.path is set, got 0")


# ---------------------------------------------------------------------------------------------------- config


def test_misspelled_key(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.sequence_colum=text")
    assert_user_error(result, "dataset.sequence_colum is not a config key", "did you mean dataset.sequence_column?")


@pytest.mark.parametrize(
    ("override", "phrase"),
    [("num_train_steps=abc", "num_train_steps=abc is not an integer"), ("adamw_kwargs.lr=fast", "is not a number")],
)
def test_value_of_the_wrong_type(tmp_path, override, phrase):
    key = override.split("=")[0]
    assert_user_error(fail("train_ddp.py", tmp_path, override), phrase, f"give {key}")


def test_unknown_config_name(tmp_path):
    result = run_in_process("train_ddp.py", "--config-name", "L0_sanit", expect_failure=True)
    assert_user_error(result, "--config-name L0_sanit: no such config", "L0_sanity")


def test_missing_required_value(tmp_path):
    result = fail("train_ddp.py", tmp_path, "--config-name", "L1_1B_perf")
    assert_user_error(result, "dataset.path has no value", "add dataset.path=<value>")


def test_fp8_on_a_machine_without_it(tmp_path):
    """CPU-only (TE missing, or TE without a GPU): the message says how to train without FP8."""
    result = fail_in_a_subprocess("train_ddp.py", tmp_path, "fp8_config.enabled=true")
    assert_user_error(result, "fp8_config.enabled=false")


def test_te_backend_on_a_machine_without_it(tmp_path):
    result = fail_in_a_subprocess("train_ddp.py", tmp_path, "+model_config_overrides.backend=te")
    assert_user_error(
        result, "backend='te' was requested but cannot run here", "+model_config_overrides.backend=torch"
    )


def test_tokenizer_directory_without_a_tokenizer(tmp_path):
    (tmp_path / "tok").mkdir()
    result = fail("train_ddp.py", tmp_path, f"tokenizer_path={tmp_path / 'tok'}")
    assert_user_error(result, "holds no tokenizer", "point tokenizer_path at")


def test_model_tag_without_config_json_is_refused_before_building_a_model(tmp_path):
    """Transformers reads a directory without config.json as the default Llama (7B): it must fail by name instead."""
    from model_setup import load_model_config

    cfg = OmegaConf.load(RECIPE_DIR / "hydra_config" / "defaults.yaml")
    cfg.model_tag = str(tmp_path)
    with pytest.raises(PathNotFoundError, match="lacks config.json"):
        load_model_config(cfg)


def test_cp_size_that_does_not_divide_the_world_size(tmp_path):
    """Under torchrun rank 0 prints the line once; torchrun's own failure report repeats it (its error file)."""
    result = fail_in_a_subprocess("train_cp.py", tmp_path, "cp_size=3", nproc=2)
    line = "error: cp_size=3 must be >= 1 and divide the number of processes (2)"
    lines = result.stderr.splitlines()
    assert sum(text.startswith(line) for text in lines) == 1, result.stderr[-3000:]
    assert any(text.strip().startswith(f"traceback : {line}") for text in lines), result.stderr[-3000:]
    assert 'train_cp.py", line' not in result.stderr  # no traceback from the script itself


def test_debug_switch_shows_the_traceback(tmp_path):
    result = fail("train_ddp.py", tmp_path, "dataset.path=/no/such/genome.fasta", env={"HYDRA_FULL_ERROR": "1"})
    assert "Traceback" in result.stderr and "PathNotFoundError" in result.stderr


# ---------------------------------------------------------------------------------------------------- resume, export


def test_resume_with_another_model_shape_keeps_the_run(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = snapshot(run)
    deeper = "+model_config_overrides.num_hidden_layers=3"
    result = run_in_process(
        "train_ddp.py", f"output_dir={run}", *FAST, "num_train_steps=4", deeper, expect_failure=True
    )
    assert_user_error(result, f"checkpoint {run}/checkpoints/step_2 holds a model of another shape", "new output_dir")
    assert snapshot(run) == before


def test_resume_with_another_strategy_keeps_the_run(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = snapshot(run)
    result = run_in_process("train_fsdp2.py", f"output_dir={run}", *FAST, "num_train_steps=4", expect_failure=True)
    assert_user_error(result, "was written by a DDP run and this is a FSDP2 run", "new output_dir")
    assert snapshot(run) == before


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json", "modeling_llama_te.py", "tokenizer.json"])
def test_generate_from_an_export_with_a_file_missing(finished_run, tmp_path, missing):
    export = shutil.copytree(finished_run / "final_model", tmp_path / "final_model")
    if missing == "tokenizer.json":
        (export / "tokenizer_config.json").unlink()
    (export / missing).unlink()
    result = run_in_process("generate.py", str(export), "--max-new-tokens", "4", expect_failure=True)
    assert_user_error(result, f"model_dir={export}", "no tokenizer" if missing == "tokenizer.json" else missing)
