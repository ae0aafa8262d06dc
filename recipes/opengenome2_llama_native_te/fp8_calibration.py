# Copied from common/fp8_calibration.py — edit the source, then run ci/check_copies.py --fix
"""Calibrate DelayedScaling's FP8 scales before the first optimizer step, so that training starts on true gradients.

TransformerEngine's ``DelayedScaling`` casts each tensor to FP8 with a scale computed from the amaxes (largest
magnitudes) of earlier steps; a tensor with no amax on record yet is cast with a scale of 1. For gradients that scale
is far off: with the loss averaged over tens of thousands of tokens their entries are around 1e-5 and smaller, at or
under the smallest step FP8 has at a scale of 1 (E5M2 1.5e-5, E4M3 2e-3), so the first step's gradients largely cast
to zero, and so do the gradients that flow from them into the layers below. Until every gradient has an amax on
record the steps train on distorted gradients, and Adam's moments carry those steps on for tens of steps. Measured on
one H200 with the passes below turned off: Llama 1B (``L1_1B_perf``, HYBRID) at a loss of 2.58 at step 10 against
bf16's 2.15, level only by step ~20; ESM-2 650M (``L1_650M``, E4M3) at 3.64 against 3.51 at step 3, within 0.01 by
step ~15. A resume repeats it wherever a checkpoint does not carry TE's FP8 state (``_extra_state``).

:func:`calibrate_delayed_scaling` runs forward and backward passes on one batch until a pass sets no new gradient
scale (each pass's amaxes, which TE takes before the cast, give the next pass its scales; 3 passes for both models
above, after which both follow bf16 from step 1: 2.16 at step 10, 3.52 at step 3). The passes' gradients are thrown
away and the random number generators left as they were, so the run's steps, data order and dropout masks are the
ones it would have had without them.
"""

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch


logger = logging.getLogger(__name__)


def uses_delayed_scaling(fp8_recipe) -> bool:
    """Whether ``fp8_recipe`` (a TE recipe object, or None) is ``DelayedScaling``, whose scales need calibrating."""
    return fp8_recipe is not None and type(fp8_recipe).__name__ == "DelayedScaling"


def _delayed_scaling_gradient_scales(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradient (backward) scale tensors of the model's TE modules that use delayed scaling.

    TE creates a module's FP8 state on its first forward under FP8 autocast, so before that pass the list is empty.
    """
    scales = []
    for module in model.modules():
        fp8_meta = getattr(module, "fp8_meta", None)
        state = fp8_meta.get("scaling_bwd") if isinstance(fp8_meta, dict) else None
        if (
            state is not None
            and hasattr(state, "amax_history")
            and isinstance(getattr(state, "scale", None), torch.Tensor)
        ):
            scales.append(state.scale)
    return scales


def count_calibrated_gradient_scales(model: torch.nn.Module) -> int:
    """How many gradient scales have left their starting value of 1 (summed over all ranks, so that every rank takes
    the same decision). TE sets a scale to ``fp8_max / amax`` once the tensor has been seen with a non-zero amax."""
    scales = _delayed_scaling_gradient_scales(model)
    device = scales[0].device if scales else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = torch.zeros((), dtype=torch.int64, device=device)
    for scale in scales:
        count += (scale != 1.0).sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count)
    return int(count.item())


def calibrate_delayed_scaling(
    model: torch.nn.Module,
    forward_backward: Callable[[], None],
    zero_grad: Callable[[], None],
    max_passes: int = 200,
) -> int:
    """Run ``forward_backward`` (one batch's forward pass and ``loss.backward()``) until a pass calibrates no new
    gradient scale, at most ``max_passes`` times; ``zero_grad`` discards each pass's gradients. Returns the number of
    passes. Call it on every rank, after the model is built (and a checkpoint resumed) and before the first step.
    """
    if max_passes < 1:
        raise ValueError(f"max_passes must be >= 1, got {max_passes}")
    cuda_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    calibrated, passes = -1, 0
    with torch.random.fork_rng(devices=cuda_devices):  # the passes must not shift dropout masks or masking
        while passes < max_passes:
            forward_backward()
            zero_grad()
            passes += 1
            now = count_calibrated_gradient_scales(model)
            if now == calibrated:
                break
            calibrated = now
        else:
            logger.warning(
                "DelayedScaling calibration stopped after %d passes with gradient scales still being set (%d so far); "
                "the first steps may train on gradients cast with scales of 1",
                max_passes,
                calibrated,
            )
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    ranks = torch.distributed.get_world_size() if distributed else 1
    logger.info(
        "DelayedScaling: %d forward/backward passes on the first batch (gradients discarded) set %d gradient scales "
        "before step 1%s",
        passes,
        max(calibrated, 0),
        f" (summed over {ranks} ranks)" if ranks > 1 else "",
    )
    return passes


def calibrate_on_first_batch(
    enabled: bool,
    fp8_recipe: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator,
    loss_of: Callable[[Any], torch.Tensor],
    grad_acc_steps: int = 1,
) -> Iterator:
    """The training loop's batch iterator, after :func:`calibrate_delayed_scaling` has run on its first batch when
    ``enabled`` (``fp8_config.calibrate_delayed_scaling``) and the FP8 recipe is ``DelayedScaling``; otherwise
    ``batches`` itself. The first batch is handed back first, so the loop trains on the same batches either way.

    ``loss_of(batch)`` computes a micro-batch's loss as the loop does (onto the device, the model's forward); it is
    divided by ``grad_acc_steps``, as the loop weights a micro-batch, so that the gradients' amaxes are those of a
    step's. The optimizer only zeroes the gradients.
    """
    if not enabled or not uses_delayed_scaling(fp8_recipe):
        return batches
    first = next(batches)
    calibrate_delayed_scaling(
        model,
        forward_backward=lambda: (loss_of(first) / grad_acc_steps).backward(),
        zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
    )
    return itertools.chain([first], batches)
