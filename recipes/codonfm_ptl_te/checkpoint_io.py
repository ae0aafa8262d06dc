"""Lightning checkpoints that a killed job cannot corrupt, and the checkpoint a relaunch resumes from.

Lightning's ``ModelCheckpoint`` decides when to save (:class:`RecipeModelCheckpoint`: every ``save_every`` steps and at
the last step, as ``step_<N>.ckpt`` files and ``last.ckpt``); the Trainer's ``CheckpointIO`` plugin decides how the
bytes reach the disk. :class:`AtomicCheckpointIO` writes each file as ``.<name>.partial`` beside its final name,
flushes it to the disk, and only then renames it over the final name. A rename within a directory is atomic, so

- a job killed mid-save leaves at most a ``.partial`` file, which ``ckpt_path="last"`` never picks (Lightning looks for
  ``last*.ckpt``) and the next save of that name overwrites;
- ``last.ckpt`` is never half-written: until the rename it is the previous good checkpoint, after it the new one.

Every strategy writes one whole file from rank 0 through this plugin: DDP, FSDP (``state_dict_type="full"``) and FSDP2
(``ModelParallelStrategy(save_distributed_checkpoint=False)``; its sharded directories would bypass the plugin).
Checkpoints hold weights, not TE's ``_extra_state`` (FP8 scaling bookkeeping, rebuilt by a resumed run);
:func:`extra_state_kept_when_absent` lets an FSDP2 resume load such a checkpoint into TE modules.

A checkpoint written before AdamW left the biases and LayerNorm weights undecayed holds one optimizer parameter group,
where this code builds two (lightning_module.configure_optimizers): :func:`resume_checkpoint` refuses it in one line
(:func:`check_optimizer_param_groups`) before anything is built.
"""

import contextlib
import io
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from user_errors import ConfigError


logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
LAST = "last.ckpt"
_STEP_FILE = re.compile(r"step_(\d+)\.ckpt")  # RecipeModelCheckpoint's filename="step_{step}"


def partial_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that never leaves a half-written checkpoint under a checkpoint's name."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(path)
        try:
            with open(partial, "wb") as file:  # streamed to the file: no second in-memory copy of the checkpoint
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())  # the bytes are on the disk before the name points at them
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)  # and the rename itself survives a crash of the node


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # a file system that cannot open directories: the rename is as durable as it gets
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def extra_state_kept_when_absent(module: torch.nn.Module) -> Iterator[None]:
    """While loading a checkpoint without ``_extra_state`` into an FSDP2 model, every sub-module keeps its own.

    ``torch.distributed.checkpoint``'s ``set_model_state_dict`` (what Lightning's ``ModelParallelStrategy`` loads a
    whole-file checkpoint through) fills each key the checkpoint lacks with a placeholder object and passes it on to
    ``load_state_dict``. TE modules reject anything but the formats they write ("RuntimeError: Unsupported checkpoint
    format"). Inside this block a ``set_extra_state`` ignores any value that is not a tensor, ``io.BytesIO`` or None:
    the module keeps its state, as in a non-strict load of a missing key.
    """
    patched = []
    for sub in module.modules():
        if type(sub).set_extra_state is torch.nn.Module.set_extra_state:
            continue  # no extra state: torch never calls it

        def set_extra_state(state, original=sub.set_extra_state) -> None:
            if state is None or isinstance(state, torch.Tensor | io.BytesIO):
                original(state)

        sub.set_extra_state = set_extra_state  # an instance attribute, removed again below
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub.set_extra_state


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """This recipe's complete checkpoints in ``ckpt_dir``, newest first: ``last.ckpt``, then the ``step_<N>.ckpt``
    files by step. (A killed save leaves only a ``.<name>.partial``, never one of these: :class:`AtomicCheckpointIO`.)"""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP_FILE.fullmatch(p.name)) and p.is_file()]
    last = [ckpt_dir / LAST] if (ckpt_dir / LAST).is_file() else []
    return last + [path for _, path in sorted(steps, reverse=True)]


def resume_checkpoint(ckpt_dir: str | os.PathLike, resume: bool) -> str | None:
    """With ``resume``, the newest complete checkpoint in ``ckpt_dir``: ``last.ckpt`` (what ``ckpt_path="last"`` finds)
    or, without one (a job killed between its first ``step_<N>.ckpt`` and ``last.ckpt``), the newest step file; None
    if there is none.

    Only complete files ever carry a ``.ckpt`` name (:class:`AtomicCheckpointIO`); leftovers of a killed save are named.
    The path is given explicitly, so that a resumed run needs no ``ModelCheckpoint`` of its own to find it.

    One ckpt_dir holds one run: without ``resume``, a ckpt_dir that holds complete checkpoints (an earlier run's) is
    refused with a :class:`ConfigError`, before anything is built or written. Otherwise the earlier run's
    ``last.ckpt`` would stay until this run's first save, and a crash before it followed by a plain relaunch would
    continue the earlier run. A checkpoint this code's optimizer cannot load is refused too
    (:func:`check_optimizer_param_groups`).
    """
    ckpt_dir = Path(ckpt_dir)
    for leftover in sorted(ckpt_dir.glob(f".*{PARTIAL_SUFFIX}")):
        logger.warning("Ignoring %s: a save that did not finish (the next save of that name replaces it)", leftover)
    complete = complete_checkpoints(ckpt_dir)
    if complete and not resume:
        more = f" and {len(complete) - 4} more" if len(complete) > 4 else ""
        names = ", ".join(p.name for p in complete[:4]) + more
        raise ConfigError(
            f"checkpoint.resume=false would start a new run, but checkpoint.ckpt_dir={ckpt_dir} holds complete "
            f"checkpoints of an earlier run ({names}; newest: {complete[0]}), which would mix with this run's: resume "
            "them (checkpoint.resume=true), start in a new output_dir (or checkpoint.ckpt_dir), or delete those .ckpt "
            "files first"
        )
    if not complete:
        return None
    if complete[0].name != LAST:
        logger.warning("No %s in %s (a save killed before writing it): the newest step file is used", LAST, ckpt_dir)
    check_optimizer_param_groups(complete[0])
    logger.info("Resuming from %s", complete[0])
    return str(complete[0])


def check_optimizer_param_groups(path: str | os.PathLike) -> None:
    """Refuse (:class:`ConfigError`) a checkpoint whose AdamW has one parameter group: one written before weight decay
    skipped the biases and LayerNorm weights. This code builds two (decayed, undecayed), and Lightning's load of one
    into two fails far from its cause: under DDP in ``Optimizer.load_state_dict`` ("a different number of parameter
    groups"), under FSDP2 only after loading, as an IndexError among the scheduler's learning rates. Reads the
    checkpoint memory-mapped: its tensors stay on the disk."""
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    states = checkpoint.get("optimizer_states") if isinstance(checkpoint, dict) else None
    if states and len(states[0].get("param_groups", ())) == 1:
        raise ConfigError(
            f"{path} was written with one optimizer parameter group, before weight decay skipped biases and LayerNorm "
            "weights, and cannot be resumed: start afresh in a new output_dir"
        )


class RecipeModelCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``save_every`` optimizer steps (and ``step_<N>.ckpt`` files, the newest ``keep``), plus
    ``last.ckpt`` at the final step with ``save_final``.

    Lightning's own ``ModelCheckpoint`` writes ``last.ckpt`` at the end of training only when it saved nothing before,
    so a run of 50 steps saving every 20 would otherwise end with the checkpoint of step 40.
    """

    def __init__(self, dirpath: str, save_every: int, keep: int, save_final: bool):
        super().__init__(
            dirpath=dirpath,
            filename="step_{step}",
            auto_insert_metric_name=False,
            monitor="step",  # "best" = newest: save_top_k keeps the newest `keep` step files
            mode="max",
            save_top_k=keep,
            save_last=True,
            every_n_train_steps=save_every or 0,
            save_on_train_epoch_end=False,
            enable_version_counter=False,  # a resumed run overwrites its own step files, never writes step_N-v1
        )
        self.save_final = save_final

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.save_final and trainer.global_step >= trainer.max_steps and not self._saved_this_step(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_final:
            super().on_train_end(trainer, pl_module)

    def _saved_this_step(self, trainer) -> bool:
        return self._last_global_step_saved == trainer.global_step
