"""train.py end to end on CPU, launched the way a user launches it (``python train.py``, ``torchrun``).

References are independent of the code under test: the validation loss must come close to the Bayes-optimal
masked-codon loss of the synthetic data and far below its unigram entropy (sanity_reference.py computes both from the
Markov chain that generated the data), an interrupted run must match an uninterrupted one bit for bit, the
Lightning loop must give the losses of a plain PyTorch loop over the same model and batches, and a step split over
two ranks must train as the same step on one rank.
"""

import json
from pathlib import Path

import pytest
import torch
from datamodule import CodonDataModule
from hydra import compose, initialize_config_dir
from launch import RECIPE_DIR, assert_logs_read_well_off_a_terminal, run_script
from safetensors.torch import load_file
from sanity_reference import reference_numbers


DROPOUT = ["model_config_overrides.hidden_dropout_prob=0.1", "model_config_overrides.attention_probs_dropout_prob=0.1"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference() -> dict:
    """Bayes-optimal loss and unigram entropy of the shipped validation set, with L0_sanity's masks (seed 42)."""
    return reference_numbers(RECIPE_DIR / "data" / "sanity_val.parquet", seed=42)


def test_l0_sanity_learns_to_near_the_bayes_optimum(tmp_path, reference):
    """The shipped L0 config, unchanged, in one process: the final validation loss is within 0.2 nats of the best any
    model can do on this data, and more than 3 nats below what codon frequencies alone give."""
    result = run_script("train.py", f"output_dir={tmp_path}", timeout=400)
    assert_logs_read_well_off_a_terminal(result)
    validations = read_jsonl(tmp_path / "val_metrics.jsonl")
    assert [v["step"] for v in validations] == [200, 400, 600]
    final = validations[-1]["val_loss"]
    assert final < reference["optimal_masked_loss"] + 0.2, (final, reference)
    assert final < reference["unigram_entropy"] - 3.0, (final, reference)
    assert final >= reference["optimal_masked_loss"] - 0.02  # nothing beats the optimum (up to float noise)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 600 and summary["final_val"]["val_loss"] == final
    assert summary["median_tokens_per_second_per_gpu"] > 0 and summary["strategy"] == "ddp"
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and (tmp_path / "final_model" / "config.json").is_file()


def test_ddp_on_two_processes_learns(tmp_path, reference):
    """DDP over 2 gloo processes (torchrun): in 100 steps the validation loss is already well below the unigram
    entropy, so both ranks train one model on their own shares. (FSDP2 on 2 processes: the resume test below.)"""
    steps = ["num_train_steps=100", "lr_scheduler_kwargs.num_decay_steps=70", "trainer.val_check_interval=100"]
    run_script("train.py", f"output_dir={tmp_path}", *steps, nproc=2, timeout=400)
    final = read_jsonl(tmp_path / "val_metrics.jsonl")[-1]["val_loss"]
    assert final < reference["unigram_entropy"] - 1.0, final
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_stop_and_resume_is_exact(tmp_path, strategy):
    """2 processes, packed (THD) batches, dropout on: 20 steps in one go, or 10 steps, stop, relaunch to 20. The
    relaunch continues from last.ckpt (weights, AdamW, schedule, each rank's data position, dropout streams) and logs
    the same losses and gradient norms, bit for bit, and ends with the same weights."""
    common = ["logger.log_every=1", "trainer.val_check_interval=7", "checkpoint.save_every=10", *DROPOUT]
    common += [f"strategy={strategy}", "data.token_budget=1024"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_script("train.py", f"output_dir={full}", "num_train_steps=20", *common, nproc=2)
    run_script("train.py", f"output_dir={resumed}", "num_train_steps=10", *common, nproc=2)
    checkpoint = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    positions = [state[0]["_index_sampler_state"] for state in checkpoint["per_rank_loader_states"]]
    assert checkpoint["global_step"] == 10 and positions[0] != positions[1]  # the ranks are at different rows
    result = run_script("train.py", f"output_dir={resumed}", "num_train_steps=20", *common, nproc=2)
    assert "Resuming from" in result.stdout + result.stderr

    expected, got = read_jsonl(full / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, 21))  # metrics.jsonl appends across the relaunch
    assert [(m["loss"], m["grad_norm"]) for m in got] == [(m["loss"], m["grad_norm"]) for m in expected]
    assert expected[-1]["loss"] < expected[0]["loss"]
    assert read_jsonl(resumed / "val_metrics.jsonl") == read_jsonl(full / "val_metrics.jsonl")
    weights = {}
    for run in (full, resumed):
        state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
        weights[run] = {k: v for k, v in state.items() if k.startswith("model.")}
    assert weights[full].keys() == weights[resumed].keys()
    for key, value in weights[full].items():
        torch.testing.assert_close(weights[resumed][key], value, rtol=0, atol=0, msg=key)


def test_a_resume_trains_with_the_learning_rate_of_its_config(tmp_path):
    """Resumed with a lower ``adamw_kwargs.lr`` (after a loss spike, say), the run trains with it from the resumed step
    on and says so: last.ckpt brings AdamW's moments and the schedule's step, not the old peak lr."""
    common = ["logger.log_every=1", "checkpoint.save_every=2", "lr_scheduler_kwargs.num_warmup_steps=4"]
    run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=2", "adamw_kwargs.lr=2e-3", *common)
    result = run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=4", "adamw_kwargs.lr=1e-3", *common)
    assert "peak lr 0.002 -> 0.001" in result.stdout + result.stderr
    lrs = [m["lr"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert lrs == pytest.approx([5e-4, 1e-3, 7.5e-4, 1e-3], rel=1e-6)


def test_resume_on_one_process_continues_the_epoch_of_two(tmp_path):
    """10 steps on 2 processes (THD), then the same command in one process: weights, optimizer and schedule resume,
    and the one rank's sampler continues from both saved positions (its state names them as the earlier world),
    so it reads the rows of the epoch the two ranks had not (the sampler's own tests check that row by row)."""
    common = ["logger.log_every=1", "checkpoint.save_every=10", "data.token_budget=1024"]
    run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=10", *common, nproc=2)
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    positions = [state[0]["_index_sampler_state"] for state in checkpoint["per_rank_loader_states"]]
    result = run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=20", *common)
    log = result.stdout + result.stderr
    assert "written by 2 rank(s), this run has 1" in log and "2 DP ranks had read" in log
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 21))
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == 20
    position = final["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_index_sampler_state"]
    assert position["dp_world_size"] == 1
    assert position["history"] == [{"dp_world_size": 2, "positions": [[p["epoch"], p["consumed"]] for p in positions]}]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_activation_recompute_trains_exactly_like_keeping_activations(tmp_path, strategy):
    """``model_config_overrides.recompute_layers`` under Lightning's DDP and FSDP2 strategies, 2 processes, dropout
    on (the recompute draws the same masks): the same losses and gradient norms, step by step, bit for bit."""
    common = ["logger.log_every=1", "num_train_steps=6", f"strategy={strategy}", "data.token_budget=1024", *DROPOUT]
    run_script("train.py", f"output_dir={tmp_path / 'plain'}", *common, nproc=2)
    run_script(
        "train.py",
        f"output_dir={tmp_path / 'recompute'}",
        *common,
        "+model_config_overrides.recompute_layers=2",
        nproc=2,
    )
    plain, recomputed = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("plain", "recompute"))
    assert [(m["loss"], m["grad_norm"]) for m in recomputed] == [(m["loss"], m["grad_norm"]) for m in plain]
    assert plain[-1]["loss"] != plain[0]["loss"]


def test_a_partial_checkpoint_is_ignored_on_resume(tmp_path):
    """A save killed mid-write leaves `.last.ckpt.partial` (checkpoint_io.py), never a torn last.ckpt: a relaunch
    resumes from the last complete checkpoint, warns about the leftover, and its next save replaces it."""
    common = ["logger.log_every=1", "trainer.val_check_interval=1000", "data.token_budget=1024"]
    run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=6", *common)
    checkpoints = tmp_path / "checkpoints"
    good = (checkpoints / "last.ckpt").read_bytes()
    partial = checkpoints / ".last.ckpt.partial"
    partial.write_bytes(good[: len(good) // 2])  # what a kill during the next save leaves
    result = run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=8", *common)
    output = result.stdout + result.stderr
    assert "Ignoring" in output and ".last.ckpt.partial" in output and "Resuming from" in output
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 9))
    assert not partial.exists()  # the save of step 8 wrote the same name through it and renamed it
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 8


def test_starting_afresh_over_an_earlier_run_is_refused(tmp_path):
    """checkpoint.resume=false where an earlier run's last.ckpt is: that file would stay until this run's first save,
    and a crash before it plus a plain relaunch would continue the earlier run. The launch stops before training with
    one line naming the directory, the checkpoint and the ways out, and leaves every file as it was; a plain relaunch
    continues the earlier run."""
    common = ["logger.log_every=1", "trainer.val_check_interval=1000", "data.token_budget=1024"]
    common += ["export_final_model=false", "checkpoint.save_every=2", "checkpoint.keep_step_checkpoints=1"]
    run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=4", *common)
    checkpoints = tmp_path / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step_4.ckpt"]

    result = run_script(
        "train.py", f"output_dir={tmp_path}", "num_train_steps=2", "checkpoint.resume=false", *common,
        expect_failure=True,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "checkpoint.resume=false" in errors[0] and str(checkpoints / "last.ckpt") in errors[0], errors[0]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before

    result = run_script("train.py", f"output_dir={tmp_path}", "num_train_steps=6", *common)
    assert "Resuming from" in result.stdout + result.stderr
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 7))


def test_lightning_gives_the_losses_of_a_plain_pytorch_loop(tmp_path):
    """benchmark_bare_loop.py trains the same model on the same batches without Lightning: every logged loss and
    gradient norm agree, so the Lightning layer (strategy, hooks, clipping, schedule) adds no arithmetic of its own."""
    common = ["num_train_steps=20", "logger.log_every=2", "data.val_fraction=0", "data.val_path=null"]
    run_script("train.py", f"output_dir={tmp_path / 'lightning'}", *common)
    run_script("benchmark_bare_loop.py", f"output_dir={tmp_path / 'bare'}", *common)
    lightning, bare = (
        read_jsonl(tmp_path / "lightning" / "metrics.jsonl"),
        read_jsonl(tmp_path / "bare" / "metrics.jsonl"),
    )
    assert [m["step"] for m in lightning] == [m["step"] for m in bare] == list(range(2, 21, 2))
    for ours, plain in zip(lightning, bare):
        assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-6), ours["step"]
        assert ours["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), ours["step"]
        assert ours["lr"] == plain["lr"]
    assert lightning[-1]["loss"] < lightning[0]["loss"] - 0.2


def l0_training_batches(dp_rank: int, dp_world_size: int, micro_batch_size: int, count: int) -> list[dict]:
    """The first ``count`` BSHD training batches of one rank of the L0 sanity data, as train.py's datamodule makes them."""
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        cfg = compose(
            config_name="L0_sanity",
            overrides=["output_dir=unused", "data.input_format=bshd", f"data.micro_batch_size={micro_batch_size}"],
        )
    data = CodonDataModule(cfg.data, dp_rank=dp_rank, dp_world_size=dp_world_size)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    return [next(batches) for _ in range(count)]


def assert_same_training_to_float32_rounding(run_dir: Path, reference_dir: Path) -> None:
    """Two runs that compute the same steps split another way: the same losses, gradient norms and exported weights
    to float32 rounding, over steps that did change the weights."""
    runs, reference = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(reference_dir / "metrics.jsonl")
    assert [m["step"] for m in runs] == [m["step"] for m in reference]
    assert [m["loss"] for m in runs] == pytest.approx([m["loss"] for m in reference], rel=1e-5)
    assert [m["grad_norm"] for m in runs] == pytest.approx([m["grad_norm"] for m in reference], rel=1e-4)
    assert reference[-1]["loss"] != reference[0]["loss"]  # the steps did change the weights
    expected = load_file(reference_dir / "final_model" / "model.safetensors")
    got = load_file(run_dir / "final_model" / "model.safetensors")
    assert got.keys() == expected.keys()
    for key, value in got.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_of_one_sequence_equal_one_rank_of_two(tmp_path, strategy):
    """The same steps split over ranks instead of batch rows: 2 ranks x 1 sequence == 1 rank x 1 batch of those 2
    sequences (BSHD, float32, no dropout, 3 steps). Equal because each rank weighs its micro-batch's mean loss by its
    share of the micro-batch's masked codons on both ranks (lightning_module.py): with each rank's own mean, as before,
    a codon on the rank that drew fewer masked codons weighed more, and here they differ at every step."""
    steps = 3
    one_rank = l0_training_batches(0, 1, micro_batch_size=2, count=steps)
    ranks = [l0_training_batches(rank, 2, micro_batch_size=1, count=steps) for rank in range(2)]
    for step in range(steps):
        masked = []
        for rank in range(2):
            # Rank r reads the r-th row of each pair of the permutation, with the masks the one rank draws for it.
            ours, row = ranks[rank][step], one_rank[step]["attention_mask"][rank].bool()
            assert ours["input_ids"].shape[0] == 1 and ours["attention_mask"][0].bool().sum() == row.sum()
            for key in ("input_ids", "labels"):
                assert torch.equal(ours[key][0][ours["attention_mask"][0].bool()], one_rank[step][key][rank][row])
            masked.append(int((ours["labels"] != -100).sum()))
        assert masked[0] != masked[1], (step, masked)  # so that a per-rank mean would weigh codons unequally

    common = [
        f"strategy={strategy}",
        f"num_train_steps={steps}",
        "logger.log_every=1",
        "data.input_format=bshd",
        "model_config_overrides.hidden_dropout_prob=0.0",
        "model_config_overrides.attention_probs_dropout_prob=0.0",
        "adamw_kwargs.eps=1e-3",  # Adam's update of a gradient near 0 would turn rounding into sign flips
        "checkpoint.save_final=false",
        "trainer.val_check_interval=1000",
    ]
    run_script("train.py", f"output_dir={tmp_path / 'ranks'}", *common, "data.micro_batch_size=1", nproc=2)
    run_script("train.py", f"output_dir={tmp_path / 'one'}", *common, "data.micro_batch_size=2")
    assert_same_training_to_float32_rounding(tmp_path / "ranks", tmp_path / "one")
