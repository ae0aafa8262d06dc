"""End-to-end runs of train_fsdp2.py and train_ddp.py on CPU, launched the way a user launches them (plain python, or
torchrun with 2 processes on gloo).

References are independent of the code under test: the loss must fall below ln 4 ~ 1.39 nats (independent bases;
lower needs context), an interrupted run must equal an uninterrupted one bit for bit, gradient accumulation must equal
one larger batch, and the export must carry the weights and settings the run trained with.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from compensated_adamw import split_master
from launch import RECIPE_DIR, run_script
from safetensors.torch import load_file
from training import FAST, LOSS_THRESHOLD, read_jsonl, train
from transformers import AutoConfig, AutoModelForCausalLM


def exported_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "final_model" / "model.safetensors")


def test_one_process_learns_validates_and_exports(l0_run):
    metrics = read_jsonl(l0_run / "metrics.jsonl")
    assert metrics[0]["loss"] > 3.0  # ln(256) ~ 5.5 at random init
    assert metrics[-1]["step"] == 60 and metrics[-1]["loss"] < LOSS_THRESHOLD, metrics
    validation = read_jsonl(l0_run / "validation.jsonl")
    assert [v["step"] for v in validation] == [30, 60]
    assert validation[-1]["val_loss"] < LOSS_THRESHOLD and validation[-1]["val_loss"] < validation[0]["val_loss"]
    assert validation[-1]["val_perplexity"] == pytest.approx(np.exp(validation[-1]["val_loss"]))

    # The export loads the way a user loads it, keeps the run's init settings and reproduces the checkpoint's weights.
    export_dir = l0_run / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    assert (config.embedding_init_std, config.scale_output_projection_init, config.tie_word_embeddings) == (
        1.0,
        True,
        False,
    )
    assert config.layer_precision is None and config.backend == "torch"
    model = AutoModelForCausalLM.from_pretrained(export_dir, config=config, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, *b"ACGTTGCAACGTAAGG"]])).logits
    assert torch.isfinite(logits).all() and logits.shape == (1, 17, 256)
    assert sorted(p.name for p in (l0_run / "checkpoints").iterdir()) == ["model_config", "step_30", "step_60"]


def test_ddp_one_process_learns_validates_and_exports(tmp_path):
    """train_ddp.py as a user starts it on one machine: it learns, validates, checkpoints and exports the init settings
    it trained with, and the export loads the way a user loads it. A config's ``checkpoint.async_save`` (FSDP2's, set
    by og2_1b_thd) is named in the log as not applying, and the checkpoint is written all the same."""
    overrides = ["num_train_steps=60", "validation.every_n_steps=30", "checkpoint.async_save=true"]
    result = run_script("train_ddp.py", f"output_dir={tmp_path}", *FAST, *overrides)
    assert "checkpoint.async_save is for FSDP2's checkpoints" in result.stdout + result.stderr
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[0]["loss"] > 3.0 and metrics[-1]["step"] == 60 and metrics[-1]["loss"] < LOSS_THRESHOLD, metrics
    validation = read_jsonl(tmp_path / "validation.jsonl")
    assert [v["step"] for v in validation] == [30, 60] and validation[-1]["val_loss"] < LOSS_THRESHOLD
    config = AutoConfig.from_pretrained(tmp_path / "final_model", trust_remote_code=True)
    assert (config.embedding_init_std, config.scale_output_projection_init) == (1.0, True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model", trust_remote_code=True).eval()
    assert torch.equal(model.state_dict()["lm_head.weight"], exported_weights(tmp_path)["lm_head.weight"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["model_config", "step_60"]


def test_ddp_takes_the_steps_fsdp2_takes(tmp_path):
    """One process, the same seed and data: train_ddp.py (the model alone) and train_fsdp2.py (one-rank FSDP2, built
    directly on the device as DDP builds it, not on the meta device, whose init draws in another order) log the same
    losses and gradient norms and export the same weights, to float32 rounding: the same optimizer groups, token
    weights, clipping and schedule on both paths."""
    common = ["num_train_steps=12", "logger.log_every=1", "validation.every_n_steps=12", "fsdp.use_meta_device=false"]
    fsdp2 = train(tmp_path / "fsdp2", *common)
    ddp = train(tmp_path / "ddp", *common, script="train_ddp.py")
    assert [m["loss"] for m in ddp] == pytest.approx([m["loss"] for m in fsdp2], rel=1e-5)
    assert [m["grad_norm"] for m in ddp] == pytest.approx([m["grad_norm"] for m in fsdp2], rel=1e-4)
    assert fsdp2[-1]["loss"] < fsdp2[0]["loss"] - 1.0  # the steps did train
    fsdp2_weights = exported_weights(tmp_path / "fsdp2")
    for key, value in exported_weights(tmp_path / "ddp").items():
        torch.testing.assert_close(value, fsdp2_weights[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_ddp.py"])
def test_two_processes_learn(tmp_path, script):
    overrides = ["num_train_steps=60", "validation.every_n_steps=60", "export_final_model=false"]
    metrics = train(tmp_path, *overrides, nproc=2, script=script)
    assert metrics[-1]["step"] == 60 and metrics[-1]["loss"] < LOSS_THRESHOLD, metrics
    assert read_jsonl(tmp_path / "validation.jsonl")[0]["val_loss"] < LOSS_THRESHOLD


def test_activation_recompute_trains_exactly_like_keeping_activations(tmp_path):
    """``model_config_overrides.recompute_layers`` under FSDP2 on two ranks (the recompute re-entering the sharded
    layer in backward): the same losses, step by step, bit for bit."""
    common = ["num_train_steps=6", "logger.log_every=1", "validation.every_n_steps=6", "export_final_model=false"]
    plain = train(tmp_path / "plain", *common, nproc=2)
    recomputed = train(tmp_path / "recompute", *common, "+model_config_overrides.recompute_layers=2", nproc=2)
    assert [m["loss"] for m in recomputed] == [m["loss"] for m in plain]
    assert plain[-1]["loss"] != plain[0]["loss"]


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_ddp.py"])
def test_stop_and_go_matches_an_uninterrupted_run(tmp_path, script):
    """2 processes, each with its own data cursor; packed batches split windows, so the resumed run starts mid-window.
    4 steps + resume to 8 must give exactly the losses, validation and weights of 8 uninterrupted steps."""
    common = ["dataset.token_budget=300", "lr_scheduler_kwargs.num_warmup_steps=2", "logger.log_every=1"]
    common += ["validation.every_n_steps=4", "validation.max_batches=2"]
    straight = train(tmp_path / "straight", "num_train_steps=8", *common, nproc=2, script=script)
    train(tmp_path / "resumed", "num_train_steps=4", "export_final_model=false", *common, nproc=2, script=script)
    resumed = train(tmp_path / "resumed", "num_train_steps=8", *common, nproc=2, script=script)
    assert [m["step"] for m in resumed] == list(range(1, 9))  # metrics.jsonl is appended to
    # Bit for bit: same data, same order of floating-point operations, same random streams.
    assert [m["loss"] for m in resumed[4:]] == [m["loss"] for m in straight[4:]]
    val = [read_jsonl(tmp_path / run / "validation.jsonl") for run in ("straight", "resumed")]
    assert [v["val_loss"] for v in val[1]] == [v["val_loss"] for v in val[0]] and len(val[0]) == 2
    resumed_weights = exported_weights(tmp_path / "resumed")
    for key, value in exported_weights(tmp_path / "straight").items():
        assert torch.equal(resumed_weights[key], value), key


def test_resume_on_one_rank_continues_a_two_rank_run(tmp_path):
    """30 steps on 2 processes, then the same command on 1 process: DCP re-shards model and optimizer, the one rank
    first finishes what each old rank had left of its file, from its cursor, then starts its own passes, and the run
    learns on to step 60. (That each token is read once is tests/test_stream_continuation.py's.)"""
    common = ["logger.log_every=1", "validation.every_n_steps=60", "export_final_model=false"]
    train(tmp_path, "num_train_steps=30", *common, nproc=2)
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path}", *FAST, "num_train_steps=60", *common, nproc=1)
    log = result.stdout + result.stderr
    assert "was written by 2 ranks, this run has 1" in log
    assert "data: 2 DP ranks had 2 file(s) of their current passes left (2 begun)" in log
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 61))
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, metrics[-5:]


def test_trains_on_globally_shuffled_parquet_shards(tmp_path):
    """The og2_*_global_shuffle path on the shipped data: reshard (chunked) to Parquet, then train from the shards."""
    sys.path.insert(0, str(RECIPE_DIR / "scripts"))
    from reshard_to_parquet import reshard

    inputs = [str(RECIPE_DIR / "data" / "sanity_train_*.jsonl.gz")]
    reshard(
        inputs, tmp_path / "shards", rows_per_shard=200, seed=3, chunk_length=254, chunk_overlap=16, progress=False
    )
    overrides = [f"dataset.path={tmp_path / 'shards'}", "dataset.format=parquet", "num_train_steps=40"]
    metrics = train(tmp_path / "run", *overrides, "validation.every_n_steps=40", "export_final_model=false")
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, metrics


@pytest.mark.parametrize(("script", "nproc"), [("train_fsdp2.py", None), ("train_ddp.py", 2)])
def test_grad_accumulation_equals_one_larger_batch(tmp_path, script, nproc):
    """2 micro-batches of 2 windows == 1 micro-batch of 4 (BSHD; the windows differ in length and in masked N runs,
    so the micro-batches score different numbers of tokens and a plain mean of their losses would differ). DDP on 2
    processes: its no_sync micro-batch and the all-reduce of the step's token count."""
    common = ["dataset.input_format=bshd", "num_train_steps=2", "adamw_kwargs.eps=1e-3", "checkpoint.save_final=false"]
    common += ["validation.path=null"]
    train(tmp_path / "acc", *common, "dataset.micro_batch_size=2", "grad_acc_steps=2", script=script, nproc=nproc)
    train(tmp_path / "big", *common, "dataset.micro_batch_size=4", "grad_acc_steps=1", script=script, nproc=nproc)
    accumulated, single = exported_weights(tmp_path / "acc"), exported_weights(tmp_path / "big")
    for key, value in single.items():
        torch.testing.assert_close(accumulated[key], value, rtol=1e-5, atol=1e-6, msg=key)
    if script == "train_fsdp2.py":  # weights kept gathered between the micro-batches: the same step, bit for bit
        kept = ["fsdp.reshard_after_forward=false", "fsdp.reshard_after_backward=false"]
        train(tmp_path / "kept", *common, "dataset.micro_batch_size=2", "grad_acc_steps=2", *kept)
        for key, value in exported_weights(tmp_path / "kept").items():
            torch.testing.assert_close(value, accumulated[key], rtol=0, atol=0, msg=key)


def test_context_parallel_run_equals_a_one_process_run(tmp_path):
    """train_cp.py with cp_size=2 on 2 processes (torch backend, dp=1) reads the same windows as train_fsdp2.py in one
    process; context parallelism must not change the arithmetic: per-step losses, gradient norms, the validation
    loss and the final weights agree. Weights are built before sharding (no meta device), so both start alike."""
    common = [
        "num_train_steps=6",
        "logger.log_every=1",
        "lr_scheduler_kwargs.num_warmup_steps=2",
        "validation.every_n_steps=6",
        "fsdp.use_meta_device=false",
        "dataset.token_budget=700",  # windows split over batches, pieces of uneven length (CP pads each to 4k)
        "+model_config_overrides.backend=torch",
    ]
    single = train(tmp_path / "single", *common)
    cp = train(tmp_path / "cp", *common, "cp_size=2", nproc=2, script="train_cp.py")
    assert [m["loss"] for m in cp] == pytest.approx([m["loss"] for m in single], rel=1e-4)
    assert [m["grad_norm"] for m in cp] == pytest.approx([m["grad_norm"] for m in single], rel=1e-3)
    single_val, cp_val = (read_jsonl(tmp_path / run / "validation.jsonl")[0] for run in ("single", "cp"))
    assert cp_val["val_tokens"] == single_val["val_tokens"]
    assert cp_val["val_loss"] == pytest.approx(single_val["val_loss"], rel=1e-4)
    for key, value in exported_weights(tmp_path / "single").items():
        torch.testing.assert_close(exported_weights(tmp_path / "cp")[key], value, rtol=1e-3, atol=1e-5)


def test_context_parallel_learns(tmp_path):
    metrics = train(
        tmp_path, "num_train_steps=60", "validation.every_n_steps=60", nproc=2, script="train_cp.py"
    )  # L0_sanity_cp: cp_size=2
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, metrics[-1]
    assert read_jsonl(tmp_path / "validation.jsonl")[0]["val_loss"] < LOSS_THRESHOLD
    assert (tmp_path / "final_model" / "model.safetensors").is_file()


def test_train_cp_refuses_cp_size_one_and_bshd(tmp_path):
    result = run_script("train_cp.py", f"output_dir={tmp_path}", "cp_size=1", expect_failure=True)
    assert "cp_size >= 2" in result.stderr
    result = run_script(
        "train_cp.py", f"output_dir={tmp_path}", "dataset.input_format=bshd", nproc=2, expect_failure=True
    )
    assert "needs dataset.input_format=thd" in result.stderr


def test_unknown_config_key_fails(tmp_path):
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path}", "dataset.sequence_colum=x", expect_failure=True)
    assert "sequence_colum" in result.stderr


def test_missing_required_value_fails_by_name(tmp_path):
    result = run_script(
        "train_fsdp2.py", "--config-name", "og2_7b_thd_gqa", f"output_dir={tmp_path}", expect_failure=True
    )
    assert "dataset.path" in result.stderr


def test_missing_data_fails_clearly(tmp_path):
    result = run_script(
        "train_fsdp2.py", f"output_dir={tmp_path}", "dataset.path=/no/such/shards", expect_failure=True
    )
    assert "dataset.path '/no/such/shards' does not exist" in result.stderr


def test_malformed_training_data_fails_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ACGT" * 50}) + "\n{oops\n")
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path}", f"dataset.path={bad}", expect_failure=True)
    assert "bad.jsonl:2: not a JSON object" in result.stderr


def test_an_error_in_validation_stops_the_run(tmp_path):
    bad = tmp_path / "bad_valid.jsonl"
    bad.write_text('{"sequence": "ACGT"}\n')
    overrides = [f"validation.path={bad}", "validation.every_n_steps=1", "num_train_steps=3"]
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path}", *overrides, expect_failure=True)
    assert "bad_valid.jsonl:1: no string under key 'text'" in result.stderr
    assert not (tmp_path / "final_model").exists()


def test_fp32_masters_held_in_the_optimizer_train_as_fp32_weights_do(tmp_path):
    """``mixed_precision.masters_in_optimizer`` (bf16 weights plus their low bits in CompensatedAdamW, float32 moments)
    against the fp32 weights it replaces, on CPU with bf16 compute, same init and data, at a learning rate where the
    runs stay on one trajectory: the losses agree to 0.01 at every logged step, and the export holds float32 weights
    that round to the checkpoint's bf16 ones (split as the optimizer splits them) with their low bits in use.
    grad_acc_steps > 1 is refused by name; train_fsdp2.py, which keeps fp32 masters its own way, runs with
    the setting switched off."""
    common = ["adamw_kwargs.lr=1e-3", "num_train_steps=40", "mixed_precision.on_cpu=true", "validation.path=null"]
    runs = {}
    for name, masters_in_optimizer in [("fp32", "false"), ("split", "true")]:
        override = f"mixed_precision.masters_in_optimizer={masters_in_optimizer}"
        runs[name] = train(tmp_path / name, *common, override, "logger.log_every=5", script="train_ddp.py")
    assert [m["step"] for m in runs["split"]] == [m["step"] for m in runs["fp32"]] == list(range(5, 41, 5))
    for fp32, split in zip(runs["fp32"], runs["split"]):
        assert abs(fp32["loss"] - split["loss"]) < 0.01, runs
    assert runs["split"][-1]["loss"] < runs["split"][0]["loss"] - 1.0, runs["split"]  # it learns

    model_state = torch.load(tmp_path / "split/checkpoints/step_40/train_state.pt", weights_only=True)["model"]
    exported = exported_weights(tmp_path / "split")
    for name, weight in exported.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(split_master(weight)[0], model_state[name]), name
    assert any(not torch.equal(weight, weight.bfloat16().float()) for weight in exported.values())

    on = "mixed_precision.masters_in_optimizer=true"
    args = [*FAST, *common, on]
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path / 'refused'}", *args, "grad_acc_steps=2", expect_failure=True
    )
    assert "needs grad_acc_steps=1" in result.stderr, result.stderr[-2000:]
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path / 'fsdp2'}", *args, "num_train_steps=2")
    assert "masters_in_optimizer is for train_ddp.py" in result.stdout + result.stderr
