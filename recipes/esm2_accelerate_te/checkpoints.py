"""The Trainer's ``checkpoint-<step>`` directories, made safe to resume from.

The Trainer writes a checkpoint (weights, optimizer, scheduler, RNG states, trainer_state.json) straight into
``output_dir/checkpoint-<step>``; a job killed half-way leaves a directory that looks like any other. And it does not
save the position of this recipe's dataloader. So, after the Trainer's save (``DataPositionCallback.on_save``):

1. every process writes its dataloader's ``state_dict`` to ``data_position/rank<r>.pt`` (written to a temporary
   name, then renamed);
2. once all have, rank 0 writes the ``COMPLETE`` marker;
3. only then are older checkpoints pruned (``max_checkpoints`` complete ones are kept; the Trainer's own
   ``save_total_limit`` is not used, because it deletes before the new checkpoint is complete).

A resumed run starts from the newest directory with the marker, and its dataloader continues at the batch after the
last one that checkpoint trained on; on another number of processes, map-style data continues the epoch
(``restore_data_position``).

One output_dir holds one run. Checkpoints are ranked and pruned by step, so a second run's checkpoints among an
earlier run's would be pruned as "oldest", outranked on the next resume, or written into the earlier run's
directories. So a launch that would mix two runs is refused before it trains (``resume_checkpoint``): starting afresh
(``resume=false``, or ``resume_from`` a checkpoint elsewhere) where complete checkpoints exist, or resuming an older
checkpoint (``resume_from``) while newer complete ones exist. Incomplete directories (a killed save) never count as a
run; before the Trainer writes ``checkpoint-<step>`` where such a directory exists, the directory is removed
(``clear_for_save``), so that a save killed half-way never leaves an old marker or data position beside new files.
"""

import logging
import os
import re
import shutil
from pathlib import Path

import torch
from user_errors import ConfigError


logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
DATA_POSITION_DIR = "data_position"
_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")


def _checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``checkpoint-<step>`` directory, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in _checkpoint_dirs(output_dir) if (path / MARKER).is_file()]


def find_resume_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None. Incomplete newer ones (a killed save) are named in the log."""
    complete = complete_checkpoints(output_dir)
    newest = complete[-1] if complete else None
    for step, path in _checkpoint_dirs(output_dir):
        if newest is None or step > newest[0]:
            logger.warning("Ignoring %s: its save did not finish (no %s marker)", path, MARKER)
    return newest[1] if newest else None


def resume_checkpoint(resume: bool, resume_from: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint a launch continues from, like the Trainer's ``resume_from_checkpoint``: ``resume_from`` (a
    ``checkpoint-<step>`` path, which must exist and be complete) if given, else with ``resume`` the newest complete
    checkpoint in output_dir (None if there is none yet), else None.

    Refuses (:class:`ConfigError`, before anything is written) a launch whose checkpoints would mix with another run's
    in output_dir: starting afresh while output_dir holds complete checkpoints, or resuming ``resume_from`` while
    output_dir holds complete checkpoints past its step, or any when ``resume_from`` lies in another directory."""
    if resume_from is None:
        if resume:
            return find_resume_checkpoint(output_dir)
        what = "would start a new run among the complete checkpoints of an earlier run"
        _refuse_to_mix("checkpoint.resume=false", what, output_dir, complete_checkpoints(output_dir))
        return None
    path = Path(resume_from)
    if not path.is_dir() or not _STEP_DIR.match(path.name):
        raise ConfigError(f"checkpoint.resume_from={resume_from}: not a checkpoint-<step> directory")
    if not (path / MARKER).is_file():
        raise ConfigError(f"checkpoint.resume_from={resume_from}: its save did not finish (no {MARKER} marker)")
    step, setting = checkpoint_step(path), f"checkpoint.resume_from={resume_from}"
    if path.resolve().parent == Path(output_dir).resolve():
        what = f"would continue from step {step} and overwrite or prune the complete checkpoints past it"
        _refuse_to_mix(setting, what, output_dir, [(s, p) for s, p in complete_checkpoints(output_dir) if s > step])
    else:
        what = f"would continue from step {step} of a run in another directory among complete checkpoints"
        _refuse_to_mix(setting, what, output_dir, complete_checkpoints(output_dir))
    return path


def _refuse_to_mix(setting: str, what: str, output_dir: str | Path, others: list[tuple[int, Path]]) -> None:
    """Raise a :class:`ConfigError` (``setting`` ``what``) naming ``others``, the complete checkpoints the launch would
    mix with, and the ways out; nothing if there are none."""
    if not others:
        return
    names = ", ".join(path.name for _, path in others[-3:])
    if len(others) > 3:
        names = f"{len(others)} checkpoints, ..., {names}"
    raise ConfigError(
        f"{setting} {what}: output_dir={output_dir} holds {names} (newest: {others[-1][1]}). Resume them "
        "(checkpoint.resume=true without checkpoint.resume_from continues the newest), start in a new output_dir, or "
        "delete those checkpoint-<step> directories first"
    )


def clear_for_save(checkpoint: Path) -> None:
    """Remove what an earlier save left at ``checkpoint`` (a killed save's files, or another run's), before the Trainer
    writes there: the marker first, so that the directory can never pass for complete, then the rest, so that no old
    data position or model shard sits beside the new files. Called by one process, before any writes."""
    if not checkpoint.exists():
        return
    logger.warning("Removing %s, left by an earlier save, before saving this step there", checkpoint)
    (checkpoint / MARKER).unlink(missing_ok=True)
    shutil.rmtree(checkpoint)


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step a ``checkpoint-<step>`` directory was saved at."""
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def data_position_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / DATA_POSITION_DIR / f"rank{rank}.pt"


def save_data_position(checkpoint: Path, rank: int, state: dict) -> None:
    path = data_position_file(checkpoint, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def restore_data_position(checkpoint: Path, dataloader, rank: int, world_size: int) -> None:
    """Put ``dataloader`` where this process's loader was when ``checkpoint`` was saved.

    On another number of processes, a loader over map-style data (``EpochBatchSampler``) continues the epoch from
    every saved process's position (``EpochBatchSampler.continue_from``: the rows no process had read are dealt out
    to the new ones); a streaming loader cannot, and the run is refused.
    """
    saved = sorted((checkpoint / DATA_POSITION_DIR).glob("rank*.pt"))
    if len(saved) == world_size:
        state = torch.load(data_position_file(checkpoint, rank), weights_only=False)
        sampler = getattr(dataloader, "batch_sampler", None)
        sampler_state = sampler.position_in(state) if hasattr(sampler, "position_in") else None
        if sampler_state is None or sampler.reads_like(sampler_state):
            dataloader.load_state_dict(state)
            return
    sampler = getattr(dataloader, "batch_sampler", None)
    if not hasattr(sampler, "continue_from"):
        raise ConfigError(
            f"{checkpoint} was written by {len(saved)} processes and its streaming data cannot continue on "
            f"{world_size}: launch with --num_processes {len(saved)}, or start afresh in a new output_dir"
        )
    states = [sampler.position_in(torch.load(data_position_file(checkpoint, r), weights_only=False)) or {}
              for r in range(len(saved))]  # fmt: skip
    try:
        data = sampler.continue_from(states)
    except (ValueError, FileNotFoundError) as err:
        data = f"the data order starts afresh ({err})"
    logger.warning(
        "%s was written by %d processes, this run has %d: weights, optimizer and schedule resume; %s",
        checkpoint,
        len(saved),
        world_size,
        data,
    )


def mark_complete(checkpoint: Path) -> None:
    (checkpoint / MARKER).write_text("every process saved its part of this checkpoint\n")


def prune_checkpoints(output_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than the newest complete
    one (they can never be resumed). Returns what was deleted."""
    complete = complete_checkpoints(output_dir)
    if not complete:
        return []
    newest_step = complete[-1][0]
    doomed = [path for _, path in complete[: -keep or None]] if keep else []
    doomed += [
        path for step, path in _checkpoint_dirs(output_dir) if step < newest_step and not (path / MARKER).exists()
    ]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        logger.info("Removed old checkpoints: %s", ", ".join(p.name for p in doomed))
    return doomed
