import logging
import shutil

import pytest
import torch
from checkpoint import COMPLETE_MARKER, Checkpointer, complete_checkpoints, find_latest_checkpoint, prune_checkpoints
from launch import run_script
from user_errors import ConfigError


def _make(ckpt_dir, name, complete=True):
    path = ckpt_dir / name
    path.mkdir(parents=True)
    if complete:
        (path / COMPLETE_MARKER).write_text("done\n")
    return path


def test_resume_picks_newest_complete_and_logs_skipped(tmp_path, caplog):
    _make(tmp_path, "step_10")
    newest = _make(tmp_path, "step_20")
    _make(tmp_path, "step_30.tmp", complete=False)  # crashed mid-save
    _make(tmp_path, "step_40", complete=False)  # renamed by hand, never marked complete
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert find_latest_checkpoint(tmp_path) == newest
    assert "step_30.tmp" in caplog.text
    assert "step_40" in caplog.text


def test_no_checkpoint_dir_means_fresh_start(tmp_path):
    assert find_latest_checkpoint(tmp_path / "missing") is None


def test_a_fresh_start_refuses_an_earlier_runs_checkpoints(tmp_path):
    """checkpoint.resume=false over complete checkpoints would mix two runs (a step they hold is not saved again,
    pruning deletes the new run's as the oldest, a later resume continues the old run): refused, nothing deleted.
    Unfinished leftovers are no obstacle."""
    checkpointer = Checkpointer(tmp_path, "ddp")
    assert Checkpointer(tmp_path / "missing", "ddp").start_afresh() == 0
    _make(tmp_path, "step_30.tmp", complete=False)
    _make(tmp_path, "step_40", complete=False)
    assert checkpointer.start_afresh() == 0
    _make(tmp_path, "step_10")
    _make(tmp_path, "step_20")
    with pytest.raises(ConfigError, match=f"{tmp_path} holds checkpoints of an earlier run \\(newest: step_20\\)"):
        checkpointer.start_afresh()
    assert [path.name for _, path in complete_checkpoints(tmp_path)] == ["step_10", "step_20"]


def test_step_numbers_sort_numerically(tmp_path):
    _make(tmp_path, "step_9")
    newest = _make(tmp_path, "step_10")
    assert find_latest_checkpoint(tmp_path) == newest


def test_pruning_keeps_newest_complete_and_in_progress(tmp_path):
    for step in (1, 2, 3, 4):
        _make(tmp_path, f"step_{step}")
    in_progress = _make(tmp_path, "step_5.tmp", complete=False)
    prune_checkpoints(tmp_path, max_checkpoints=2)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [3, 4]
    assert in_progress.is_dir()


def test_pruning_never_deletes_the_newest_complete(tmp_path):
    for step in (1, 2):
        _make(tmp_path, f"step_{step}")
    prune_checkpoints(tmp_path, max_checkpoints=0)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2]
    prune_checkpoints(tmp_path, max_checkpoints=None)  # None keeps everything
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def test_pruning_killed_midway_leaves_no_checkpoint_without_marker(tmp_path, monkeypatch):
    """A job killed while pruning, after the marker happened to be deleted first (rmtree deletes in directory order):
    what is left must not be a step_N without its marker, which no prune would ever remove; the next prune cleans up."""
    for step in (1, 2, 3):
        _make(tmp_path, f"step_{step}")
        (tmp_path / f"step_{step}" / "train_state.pt").write_bytes(b"weights")
    real_rmtree = shutil.rmtree

    def killed_rmtree(path, ignore_errors=False):
        (path / COMPLETE_MARKER).unlink()
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    with pytest.raises(Killed):
        prune_checkpoints(tmp_path, max_checkpoints=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    unmarked = [p.name for p in tmp_path.glob("step_*") if p.suffix == "" and not (p / COMPLETE_MARKER).exists()]
    assert not unmarked
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_3"

    prune_checkpoints(tmp_path, max_checkpoints=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


@pytest.mark.parametrize(
    ("strategy", "mode", "nproc"),
    # DDP's save/resume is covered end to end by test_train.py's stop-and-go run. Megatron-FSDP's background write
    # (a CPU copy made by the Checkpointer, written by its own thread) runs here over FSDP2's DTensors: training goes
    # on while it writes, and the resume must still see the weights of the step it saved.
    [("ddp", "sync", None), ("fsdp2", "sync", None), ("fsdp2", "async", 2), ("mfsdp", "async", 2)],
)
def test_save_then_resume_continues_identically(tmp_path, strategy, mode, nproc):
    result_file = tmp_path / "result.pt"
    run_script("tests/checkpoint_worker.py", strategy, mode, str(tmp_path / "ckpt"), str(result_file), nproc=nproc)
    result = torch.load(result_file, weights_only=False)
    events = result["events"]

    if mode == "async":
        # The save returned while the write was still owned by the background future: not yet complete/renamed.
        assert events["pending_after_save"]
        assert not events["final_dir_right_after_save"]
    else:
        assert events["final_dir_right_after_save"]
        assert not events["tmp_dir_right_after_save"]
    assert events["complete_after_close"]
    assert events["rank_files"] == [f"rank{r}_state.pt" for r in range(nproc or 1)]

    assert result["resumed_step"] == 3  # the debris step_8 / step_9.tmp were passed over
    assert result["resumed_losses"] == result["losses"][3:]  # bit-identical: data order, RNG, optimizer all restored
    for name, expected in result["expected_params"].items():
        torch.testing.assert_close(result["resumed_params"][name], expected, rtol=0, atol=0)

    # Resumed with lr 5e-3 and weight decay 0.1 in the config (the checkpoint's run: 1e-2 and 0.01): the config's
    # settings and its schedule's lr at step 3 (warmup 2, then 10 decay steps: 0.9 of the peak) apply, while the
    # weights and AdamW's moments are the checkpoint's (the first loss is the plain resume's).
    changed = result["changed"]
    assert changed["lr"] == changed["last_lr"] == [5e-3 * 0.9]
    assert changed["next_lr"] == [5e-3 * 0.8]
    assert changed["weight_decay"] == [0.1]
    assert changed["loss"] == result["resumed_losses"][0]
    for name, exp_avg in result["resumed_exp_avg"].items():
        assert exp_avg.abs().sum() > 0
        torch.testing.assert_close(changed["exp_avg"][name], exp_avg, rtol=0, atol=0)


@pytest.mark.parametrize(("strategy", "old_world", "new_world"), [("fsdp2", 2, 1), ("fsdp2", 1, 2), ("ddp", 2, 1)])
def test_resume_on_another_number_of_ranks_restores_the_state_and_finishes_the_epoch(
    tmp_path, strategy, old_world, new_world
):
    """Model and optimizer come back whole (DCP re-shards FSDP2's), and the new ranks read exactly the rows of the
    epoch that the old ones had not (the data is a ``StatefulDataLoader`` with a worker over ``EpochBatchSampler``)."""
    ckpt_dir, saved_file, resumed_file = tmp_path / "ckpt", tmp_path / "saved.pt", tmp_path / "resumed.pt"
    run_script("tests/elastic_worker.py", strategy, "save", str(ckpt_dir), str(saved_file), nproc=old_world)
    result = run_script(
        "tests/elastic_worker.py", strategy, "resume", str(ckpt_dir), str(resumed_file), nproc=new_world
    )
    saved, resumed = torch.load(saved_file, weights_only=False), torch.load(resumed_file, weights_only=False)

    assert resumed["step"] == saved["step"] == 3
    for name, value in saved["state"]["model"].items():
        torch.testing.assert_close(resumed["state"]["model"][name], value, rtol=0, atol=0, msg=name)
    for name, moments in saved["state"]["optimizer"].items():
        for key, value in moments.items():
            torch.testing.assert_close(resumed["state"]["optimizer"][name][key], value, rtol=0, atol=0, msg=name)

    read_before = [row for rows in saved["rows"] for row in rows]
    read_after = [row for rows in resumed["rows"] for row in rows]
    assert len(read_before) == old_world * 3 * 2  # 3 steps of 2 rows on every old rank
    assert not set(read_before) & set(read_after) and len(set(read_after)) == len(read_after)
    unread = 61 - len(read_before)
    assert len(read_after) == unread - unread % new_world  # all the rest, but for drop_last's remainder
    assert f"written by {old_world} ranks, this run has {new_world}" in result.stderr
    assert f"{old_world} DP ranks had read {len(read_before)} of epoch 0's 61 rows" in result.stderr


def test_a_loader_state_of_other_worker_count_without_a_data_order_is_refused_clearly():
    """torchdata's own check is a bare AssertionError; without a data order to restore instead, say what to set."""
    from checkpoint import _load_loader_state
    from torchdata.stateful_dataloader import StatefulDataLoader

    saved = StatefulDataLoader(list(range(8)), batch_size=2, num_workers=0).state_dict()
    two_workers = StatefulDataLoader(list(range(8)), batch_size=2, num_workers=2)
    with pytest.raises(
        ConfigError, match="ran 0 worker process\\(es\\) and this run's runs 2: resume with dataset.num_workers=0"
    ):
        _load_loader_state(two_workers, saved, None, None)
