# Copied from common/scheduler.py — edit the source, then run ci/check_copies.py --fix
"""Learning-rate schedule: linear warmup, then linear decay to a floor.

The schedule is independent of ``num_train_steps`` on purpose: a run that stops at step N and resumes to 2N sees
the same learning rates as an uninterrupted 2N-step run.
"""

import torch
from torch.optim.lr_scheduler import LambdaLR
from user_errors import ConfigError


def warmup_linear_decay_ratio(step: int, num_warmup_steps: int, num_decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier on the peak learning rate for the optimizer step with 0-based index ``step``.

    - warmup, ``step < num_warmup_steps``: ``(step + 1) / num_warmup_steps``, so the first step already learns
      (a ratio of 0 would waste it) and step ``num_warmup_steps - 1`` reaches the peak;
    - decay, the next ``num_decay_steps`` steps: from 1 down to ``min_lr_ratio`` linearly,
      ``1 - (1 - min_lr_ratio) * (step - num_warmup_steps) / num_decay_steps``;
    - afterwards: ``min_lr_ratio``.
    """
    if step < num_warmup_steps:
        return (step + 1) / num_warmup_steps
    if num_decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - num_warmup_steps) / num_decay_steps)
    return 1.0 - (1.0 - min_lr_ratio) * progress


def get_linear_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_decay_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """LambdaLR following :func:`warmup_linear_decay_ratio`; its state_dict is just the step counter."""
    if num_warmup_steps < 0 or num_decay_steps < 0:
        raise ConfigError(
            f"lr_scheduler_kwargs.num_warmup_steps ({num_warmup_steps}) and num_decay_steps ({num_decay_steps}) must "
            "be >= 0"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler_kwargs.min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")

    def lr_lambda(step: int) -> float:
        return warmup_linear_decay_ratio(step, num_warmup_steps, num_decay_steps, min_lr_ratio)

    return LambdaLR(optimizer, lr_lambda)
