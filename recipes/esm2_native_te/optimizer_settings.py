# Copied from common/optimizer_settings.py — edit the source, then run ci/check_copies.py --fix
"""A resumed run trains with its config's optimizer settings, not with those stored in the checkpoint.

A checkpoint's optimizer state carries each parameter group's settings (``lr``, ``betas``, ``eps``, ``weight_decay``,
...) and the LR scheduler's state carries the peak learning rates (``base_lrs``). Loading them as PyTorch does would
silently undo a resume-time override, such as a lower ``adamw_kwargs.lr`` after a loss spike, while the schedule's
shape (its warmup and decay steps live in the scheduler's function, not in its state) follows the new config: half
of the config would apply. So every entrypoint captures the freshly built optimizer's and scheduler's settings
(:func:`configured_settings`) before it loads a checkpoint, and puts them back after it
(:func:`restore_configured_settings`): the moments of each parameter (AdamW's state) and the step count come from
the checkpoint, the settings from the config, and the learning rate of the resumed step is the config's schedule at
that step. Whatever differs from the checkpoint is logged as a warning, so a changed config never resumes silently.
With an unchanged config nothing is touched, and the run continues bit for bit.
"""

import logging
from dataclasses import dataclass

import torch


logger = logging.getLogger(__name__)

# Not settings: the parameters themselves, and the learning rates the scheduler derives from base_lrs.
_DERIVED_KEYS = ("params", "lr", "initial_lr")


@dataclass(frozen=True)
class ConfiguredSettings:
    """A freshly built optimizer's settings per parameter group, and its scheduler's peak learning rates."""

    groups: tuple[dict, ...]
    base_lrs: tuple[float, ...]


def configured_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler):
    """The settings of ``optimizer`` (per parameter group, without ``params`` and the scheduled ``lr``) and the peak
    learning rates of ``scheduler`` as the config built them; call before loading a checkpoint into them."""
    groups = tuple(_settings(group) for group in optimizer.param_groups)
    return ConfiguredSettings(groups=groups, base_lrs=tuple(float(lr) for lr in scheduler.base_lrs))


def restore_configured_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    configured: ConfiguredSettings,
    checkpoint: str,
) -> list[str]:
    """After a checkpoint was loaded into ``optimizer`` and ``scheduler``: put back the ``configured`` settings and
    set each group's learning rate to the config's schedule at the scheduler's step. Return (and log as a warning)
    one line per setting that differed from the checkpoint's; an empty list changes nothing."""
    if len(optimizer.param_groups) != len(configured.groups):
        raise RuntimeError(
            f"the optimizer has {len(optimizer.param_groups)} parameter groups after loading {checkpoint}, the config "
            f"built {len(configured.groups)}"
        )
    step = scheduler.last_epoch
    changes, scheduled = [], []
    groups = zip(
        optimizer.param_groups, configured.groups, scheduler.base_lrs, configured.base_lrs, scheduler.lr_lambdas
    )
    for index, (group, settings, saved_base, base_lr, lr_lambda) in enumerate(groups):
        where = f"group {index}: " if len(configured.groups) > 1 else ""
        for key, value in settings.items():
            if key not in group or not _same(group[key], value):
                changes.append(f"{where}{key} {group.get(key, '(unset)')!r} -> {value!r}")
                group[key] = value
        lr = base_lr * lr_lambda(step)  # LambdaLR's own formula, so an unchanged config gives the very same float
        if saved_base != base_lr:
            changes.append(f"{where}peak lr {saved_base!r} -> {base_lr!r}")
        if group["lr"] != lr:
            changes.append(f"{where}lr at step {step} {group['lr']!r} -> {lr!r} (the config's schedule)")
        group["initial_lr"] = base_lr
        group["lr"] = lr
        scheduled.append(lr)
    scheduler.base_lrs = list(configured.base_lrs)
    scheduler._last_lr = scheduled  # what get_last_lr() reports until the next scheduler.step()
    if changes:
        logger.warning(
            "Resuming from %s with this run's optimizer settings, not the checkpoint's: %s",
            checkpoint,
            "; ".join(changes),
        )
    return changes


def _settings(group: dict) -> dict:
    return {key: _copy(value) for key, value in group.items() if key not in _DERIVED_KEYS}


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return list(value)
    return value


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.as_tensor(a).tolist() == torch.as_tensor(b).tolist()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
