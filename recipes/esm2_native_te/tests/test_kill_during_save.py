"""Kill training with SIGKILL at random moments, mostly while a checkpoint is being saved, and resume each time.

A kill takes down the whole process tree (torchrun, both ranks, data-loader workers) at one instant, with no chance
to clean up, as a node failure would. The runs save every step or two and keep two checkpoints, so writes, renames
and pruning are always under way. Checked after every kill: no ``step_N`` directory lacks its ``COMPLETE`` marker (a
``.tmp`` may be left behind). Checked on every relaunch: it resumes from the newest complete checkpoint on disk.
Checked at the end: every loss and gradient norm ever logged, and the exported weights, are bit-identical to an
uninterrupted run's. Bit-identical as in test_train.py's stop-and-go test: a resume restores the weights, optimizer,
schedule, data position and RNG streams, so the resumed run does the same arithmetic on the same data.

    RUN_SLOW=1 pytest tests/test_kill_during_save.py    # 30 kills; README "Reliability" has the results
"""

import contextlib
import json
import random
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from launch import kill_process_tree, start_script
from test_train import FAST, TINY_MODEL, load_export, read_metrics


@dataclass(frozen=True)
class Config:
    script: str
    overrides: tuple[str, ...]
    save_every: int
    save_s: float  # how long one save lasts here on two CPU cores: aimed kills land within it


CONFIGS = {
    # DDP: rank 0 torch.saves the train state; a data-loader worker process holds part of the data position.
    "ddp": Config("train_ddp.py", ("dataset.input_format=bshd", "dataset.num_workers=1"), 1, 0.015),
    # FSDP2: both ranks write their shards of a DCP checkpoint, every other step.
    "fsdp2": Config("train_fsdp2.py", ("dataset.input_format=thd", "dataset.num_workers=0"), 2, 0.15),
    # FSDP2 writing in a background thread: a save is still in flight while the next step trains.
    "fsdp2_async": Config(
        "train_fsdp2.py", ("dataset.input_format=thd", "dataset.num_workers=0", "checkpoint.async_save=true"), 1, 0.25
    ),
}
MAX_CHECKPOINTS = 2
TIMEOUT_S = 300  # a launch that neither saves nor exits within this has hung


def overrides(config: Config, output_dir: Path, steps: int) -> list[str]:
    return [
        f"output_dir={output_dir}",
        TINY_MODEL,
        *FAST,
        *config.overrides,
        "adamw_kwargs.lr=3e-3",
        "lr_scheduler_kwargs.num_warmup_steps=10",
        "lr_scheduler_kwargs.num_decay_steps=70",
        "logger.log_every=1",
        f"checkpoint.save_every={config.save_every}",
        f"checkpoint.max_checkpoints={MAX_CHECKPOINTS}",
        f"num_train_steps={steps}",
    ]


# --------------------------------------------------------------------------------------------------------------------
# The checkpoint directory, read without the code under test
# --------------------------------------------------------------------------------------------------------------------


def step_dirs(ckpt_dir: Path) -> dict[int, Path]:
    if not ckpt_dir.is_dir():
        return {}
    return {int(m.group(1)): p for p in ckpt_dir.iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))}


def complete_steps(ckpt_dir: Path) -> list[int]:
    return sorted(step for step, path in step_dirs(ckpt_dir).items() if (path / "COMPLETE").is_file())


def tmp_dirs(ckpt_dir: Path) -> dict[str, tuple[int, int]]:
    """Name -> (inode, ctime) of every ``step_*.tmp``: a save that starts that step over makes a new directory."""
    found = {}
    for path in ckpt_dir.glob("step_*.tmp") if ckpt_dir.is_dir() else []:
        with contextlib.suppress(FileNotFoundError):  # renamed between the listing and the stat
            stat = path.stat()
            found[path.name] = (stat.st_ino, stat.st_ctime_ns)
    return found


def fresh_tmp_dirs(ckpt_dir: Path, before: dict[str, tuple[int, int]]) -> set[str]:
    return {name for name, identity in tmp_dirs(ckpt_dir).items() if before.get(name) != identity}


# --------------------------------------------------------------------------------------------------------------------
# The trial loop
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Trials:
    kills: int = 0
    aimed: int = 0  # kills timed to land inside a save
    mid_write: int = 0  # a .tmp this launch had made was left: the kill landed while a checkpoint was being written
    mid_prune: int = 0  # more complete checkpoints than the limit were left: the kill landed between rename and prune
    launches: int = 0
    resumed_from: list[int] = field(default_factory=list)


def kill_during_save(process: subprocess.Popen, ckpt_dir: Path, saves: int, delay_s: float) -> bool:
    """Kill the launch ``delay_s`` after it starts its ``saves``-th save; False if it finished first."""
    tmp_before, final_before = tmp_dirs(ckpt_dir), set(step_dirs(ckpt_dir))
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        # A save shows as a new .tmp, or as a new step_N should its .tmp have come and gone between two looks.
        started = {int(name[5:-4]) for name in fresh_tmp_dirs(ckpt_dir, tmp_before)}
        if len(started | (set(step_dirs(ckpt_dir)) - final_before)) >= saves:
            break
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the launch neither saved nor exited"
        time.sleep(0.0005)  # a tiny model's save lasts milliseconds
    time.sleep(delay_s)
    kill_process_tree(process.pid)
    process.wait()
    return True


def metrics_of_this_launch(before: str, output_dir: Path, newest_complete: int) -> list[dict]:
    """The metrics lines the last launch wrote. A resumed run first drops the lines after its checkpoint's step
    (perf_logger.drop_metrics_after), so its own lines follow the kept ones; otherwise they follow all of them."""
    if not (output_dir / "metrics.jsonl").exists():
        return []
    now = read_metrics(output_dir)  # every line must parse: a torn line would spoil the next launch's appends
    earlier = [json.loads(line) for line in before.splitlines()]
    if now[: len(earlier)] == earlier:
        return now[len(earlier) :]
    kept = [m for m in earlier if m["step"] <= newest_complete]
    assert now[: len(kept)] == kept, "the resumed run changed metrics lines up to its checkpoint"
    return now[len(kept) :]


def check_resume(log: str, new_metrics: list[dict], newest_complete: int) -> None:
    """The launch resumed from the newest complete checkpoint (0: none, start afresh), as far as it got."""
    resumed = [int(step) for step in re.findall(r"Resumed from \S+ \(step (\d+)\)", log)]
    assert resumed in ([newest_complete], []), f"resumed from {resumed}, newest complete was {newest_complete}"
    if new_metrics:  # it got as far as training: then the resume, if any, was logged too
        assert resumed == ([newest_complete] if newest_complete else []), (resumed, newest_complete)
        assert new_metrics[0]["step"] == newest_complete + 1, (new_metrics[0]["step"], newest_complete)


def train_with_kills(
    config: Config, output_dir: Path, steps: int, kills: int, rng: random.Random, aimed_share: float
) -> Trials:
    """Launch, kill, relaunch, until ``kills`` kills have landed; then let the last launch finish."""
    ckpt_dir, metrics_file = output_dir / "checkpoints", output_dir / "metrics.jsonl"
    output_dir.mkdir(parents=True)
    trials = Trials()
    while True:
        newest_complete = max(complete_steps(ckpt_dir), default=0)
        trials.resumed_from.append(newest_complete)
        tmp_before = tmp_dirs(ckpt_dir)
        lines_before_text = metrics_file.read_text() if metrics_file.exists() else ""
        log_file = output_dir / f"launch{trials.launches}.log"
        process = start_script(config.script, *overrides(config, output_dir, steps), log_file=log_file, nproc=2)
        trials.launches += 1
        killed = False
        if trials.kills < kills:
            # Aimed: within the length of a save, after it starts. Otherwise anywhere in the next two or three
            # steps: mostly compute, sometimes a save, a prune or a metrics write.
            aimed = rng.random() < aimed_share
            delay_s = rng.uniform(0, config.save_s) if aimed else rng.uniform(0, 0.5)
            killed = kill_during_save(process, ckpt_dir, saves=rng.randint(1, 3), delay_s=delay_s)
            trials.aimed += aimed and killed
        if not killed:
            assert process.wait(timeout=TIMEOUT_S) == 0, log_file.read_text()[-5000:]
        # Every line must parse (read_metrics): a torn last line would also spoil the relaunch's first append.
        new_metrics = metrics_of_this_launch(lines_before_text, output_dir, newest_complete)
        check_resume(log_file.read_text(), new_metrics, newest_complete)
        if not killed:
            return trials
        trials.kills += 1
        unmarked = [path.name for path in step_dirs(ckpt_dir).values() if not (path / "COMPLETE").is_file()]
        assert not unmarked, f"checkpoint directories without a COMPLETE marker after a kill: {unmarked}"
        trials.mid_write += bool(fresh_tmp_dirs(ckpt_dir, tmp_before))
        trials.mid_prune += len(complete_steps(ckpt_dir)) > MAX_CHECKPOINTS


def assert_matches_uninterrupted(config: Config, output_dir: Path, reference_dir: Path, steps: int) -> None:
    reference = {m["step"]: m for m in read_metrics(reference_dir)}
    assert sorted(reference) == list(range(1, steps + 1))
    logged = read_metrics(output_dir)  # a step logged before a kill and again after the resume appears twice
    assert {m["step"] for m in logged} == set(reference)
    for m in logged:
        expected = reference[m["step"]]
        assert (m["loss"], m["grad_norm"]) == (expected["loss"], expected["grad_norm"]), f"step {m['step']}"
    expected_weights = load_export(reference_dir).state_dict()
    for name, value in load_export(output_dir).state_dict().items():
        torch.testing.assert_close(value, expected_weights[name], rtol=0, atol=0, msg=name)
    # The last launch saved again every step whose save a kill had cut short, and pruned down to the limit.
    left = {path.name for path in (output_dir / "checkpoints").iterdir()}
    assert left == {f"step_{steps - config.save_every}", f"step_{steps}"}, left
    assert complete_steps(output_dir / "checkpoints") == [steps - config.save_every, steps]


def run_trials(name: str, tmp_path: Path, steps: int, kills: int, seed: int, aimed_share: float) -> None:
    config, start = CONFIGS[name], time.monotonic()
    (tmp_path / "reference").mkdir()
    reference = start_script(
        config.script, *overrides(config, tmp_path / "reference", steps), log_file=tmp_path / "reference.log", nproc=2
    )
    assert reference.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "reference.log").read_text()[-5000:]
    trials = train_with_kills(config, tmp_path / "killed", steps, kills, random.Random(seed), aimed_share)
    assert trials.kills == kills
    assert_matches_uninterrupted(config, tmp_path / "killed", tmp_path / "reference", steps)
    print(json.dumps({"config": name, **vars(trials), "wall_s": round(time.monotonic() - start)}))  # pytest -s


def test_killed_twice_during_async_saves_resumes_exactly(tmp_path):
    """The CI version (about 80 s): two kills aimed at FSDP2's asynchronous DCP saves."""
    run_trials("fsdp2_async", tmp_path, steps=12, kills=2, seed=0, aimed_share=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_killed_ten_times_resumes_exactly(tmp_path, name):
    """Ten kills per configuration, 30 in all, 60% aimed at saves (about 3 minutes per configuration)."""
    run_trials(name, tmp_path, steps=100, kills=10, seed=list(CONFIGS).index(name), aimed_share=0.6)
