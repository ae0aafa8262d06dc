"""Mistakes a user makes end train.py and predict.py with one ``error: ...`` line and exit status 2, no traceback."""

import pytest
from launch import assert_user_error, run_in_process, run_script


# Errors found before the Trainer starts run in this process (run_in_process: no new interpreter importing torch), with
# the GPUs hidden as on a CPU machine (CUDA is not set up in this process before the first run that needs it).
NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_key=1"], "error: no_such_key is not a config key"),
        (["data.token_budgett=4096"], "did you mean data.token_budget?"),
        (["num_train_steps=many"], "num_train_steps=many is not an integer"),
        (["--config-name", "encodon_80m"], "has no value ('???' in the config)"),
        (["model_tag=/no/such/model"], "model_tag=/no/such/model: no such directory"),
        (["+model_config_overrides.hidden_sise=64"], "model_config_overrides has keys ['hidden_sise']"),
        (["fp8_config.enabled=true"], "fp8_config.enabled=false"),  # no TE here, or TE but no GPU: both say so
        (  # a shape FP8 GEMMs cannot take fails first, on every machine
            ["fp8_config.enabled=true", "++model_config_overrides.intermediate_size=100"],
            "multiples of 16, got intermediate_size 100",
        ),
        (["strategy=fsdp"], "strategy=fsdp (Lightning's FSDPStrategy) needs CUDA GPUs"),
        (["strategy=zero3"], "strategy=zero3: choose one of ddp, fsdp, fsdp2"),
        (["trainer.precision=16-mixed"], "trainer.precision=16-mixed: choose one of bf16-mixed, 32-true"),
        (["+trainer.max_steps=5"], "trainer.max_steps is set by this recipe"),
        (["data.task=classification"], "data.task=classification needs data.num_classes"),
    ],
)
def test_train_reports_user_errors_in_one_line(tmp_path, args, message):
    result = run_in_process("train.py", f"output_dir={tmp_path}", *args, env=NO_GPUS, expect_failure=True)
    assert_user_error(result, message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.predict_path=data/sanity_val.parquet"], "model_path has no value"),
        (["model_path=/no/such.ckpt", "data.predict_path=x.fasta"], "model_path=/no/such.ckpt: no such export"),
    ],
)
def test_predict_reports_user_errors_in_one_line(tmp_path, args, message):
    result = run_in_process("predict.py", f"output_dir={tmp_path}", *args, env=NO_GPUS, expect_failure=True)
    assert_user_error(result, message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.train_path=/no/such/file.parquet"], "data.train_path=/no/such/file.parquet: no such file"),
        (["+model_config_overrides.backend=te"], "backend='te' was requested but cannot run here"),
        (["--config-name", "L0_finetune", "finetune.init_from=/no/such/export"], "finetune.init_from=/no/such/export"),
    ],
)
def test_errors_found_once_the_trainer_runs_are_one_line_too(tmp_path, args, message):
    assert_user_error(run_script("train.py", f"output_dir={tmp_path}", *args, expect_failure=True), message)


def test_a_user_error_under_torchrun_is_one_line(tmp_path):
    """Two ranks: only rank 0 prints the line (the ranks print no traceback; torchrun then prints its own failure
    report, whose "traceback :" field names the same line)."""
    result = run_script("train.py", f"output_dir={tmp_path}", "data.max_codons=0", nproc=2, expect_failure=True)
    line = "error: data.max_codons must be a positive integer, got 0"
    assert [text for text in result.stderr.splitlines() if text.startswith("error:")] == [line]
    assert f"traceback : {line}" in result.stderr
