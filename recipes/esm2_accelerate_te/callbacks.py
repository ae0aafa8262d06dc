"""Trainer callbacks: what this recipe adds to the Trainer's loop, each hooked in where the Trainer expects it.

- :class:`PerfCallback`: tokens/s/GPU, MFU, loss and gradient norm into ``metrics.jsonl`` and ``summary.json``
  (perf_logger.py, the same numbers as recipes/esm2_native_te), plus whether FP8 really ran (fp8_evidence.py).
- :class:`StopAfterStepsCallback`: end this launch after a step, with a checkpoint (a job with a time limit).
- :class:`FinalCheckpointCallback`: checkpoint the last step, so that a later launch can continue.
- :class:`DataPositionCallback`: complete each checkpoint with the dataloader's position (checkpoints.py).
"""

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoints import mark_complete, prune_checkpoints, save_data_position
from fp8_evidence import count_modules_with_fp8_amax
from perf_logger import PerfLogger
from transformers import TrainerCallback


logger = logging.getLogger(__name__)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class PerfCallback(TrainerCallback):
    """Feeds :class:`PerfLogger` once per optimizer step.

    The Trainer computes the gradient norm and hands it out only in its logs, after ``on_step_end``; so the logging
    steps (``logger.log_every``, which is also the Trainer's ``logging_steps``) are recorded in ``on_log``.

    The learning rate is the one the optimizer step used: read in ``on_optimizer_step``, after ``optimizer.step()``
    and before the Trainer steps the scheduler (by ``on_step_end`` the scheduler already holds the next step's rate).
    """

    def __init__(self, trainer, perf: PerfLogger, log_every: int, fp8_requested: bool):
        self.trainer, self.perf, self.log_every, self.fp8_requested = trainer, perf, log_every, fp8_requested
        self._pending = None  # (step, loss, lr) of a logging step, until its grad norm arrives
        self._step_lr = float("nan")  # the rate of the optimizer step in progress

    def on_optimizer_step(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if lr_scheduler is not None:
            self._step_lr = lr_scheduler.get_last_lr()[0]
        elif optimizer is not None:
            self._step_lr = optimizer.param_groups[0]["lr"]

    def on_step_end(self, args, state, control, **kwargs):
        loss = self.trainer.take_step_loss()
        lr, self._step_lr = self._step_lr, float("nan")
        if state.global_step % self.log_every == 0 or state.global_step == state.max_steps:
            self._pending = (state.global_step, loss, lr)
            control.should_log = True
        else:
            self.perf.log_step(state.global_step, loss, None, lr)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is None or "loss" not in (logs or {}):
            return
        step, loss, lr = self._pending
        self._pending = None
        grad_norm = (logs or {}).get("grad_norm")
        self.perf.log_step(step, loss, None if grad_norm is None else torch.tensor(grad_norm), lr)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._pending is not None:  # a logging step whose Trainer log never came
            step, loss, lr = self._pending
            self.perf.log_step(step, loss, None, lr)
        fp8_modules = count_modules_with_fp8_amax(model) if model is not None else 0
        if self.fp8_requested:
            log = logger.info if fp8_modules else logger.warning
            log("FP8 check: %d TransformerEngine modules recorded FP8 amax values (0 = no FP8 GEMM ran)", fp8_modules)
        summary = self.perf.finish()
        if summary is not None:  # rank 0
            summary.update(fp8_requested=self.fp8_requested, fp8_modules_with_amax=fp8_modules)
            (self.perf.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


class StopAfterStepsCallback(TrainerCallback):
    def __init__(self, stop_after_steps: int | None):
        self.stop_after_steps = stop_after_steps

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_after_steps is not None and state.global_step >= self.stop_after_steps:
            logger.info("Stopping after step %d (stop_after_steps), with a checkpoint", state.global_step)
            control.should_save = True
            control.should_training_stop = True


class FinalCheckpointCallback(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_save = True


class DataPositionCallback(TrainerCallback):
    """After the Trainer's save: the dataloader position of every process, the COMPLETE marker, then pruning."""

    def __init__(self, dataloader, max_checkpoints: int | None):
        self.dataloader, self.max_checkpoints = dataloader, max_checkpoints

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        save_data_position(checkpoint, args.process_index, self.dataloader.state_dict())
        _barrier()  # every process's part (the Trainer's files included) is on disk
        if args.process_index == 0:
            mark_complete(checkpoint)
            prune_checkpoints(args.output_dir, self.max_checkpoints)
            logger.info("Saved checkpoint %s", checkpoint)
        _barrier()
