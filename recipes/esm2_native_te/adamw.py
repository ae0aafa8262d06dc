# Copied from common/adamw.py — edit the source, then run ci/check_copies.py --fix
"""The recipes' AdamW: ``CompensatedAdamW`` on CUDA (its float32 kernel for fp32 weights), torch's elsewhere.

The config keys it reads (see each recipe's ``hydra_config/defaults.yaml``)::

    adamw_kwargs: {lr, betas, eps, weight_decay}       # torch.optim.AdamW's arguments
    mixed_precision: {enabled, on_cpu, fp32_master_weights, compensate_bf16_updates}

With bf16 weights (``mixed_precision.fp32_master_weights: false``) torch's AdamW rounds every update to bf16, so an
update smaller than half a bf16 step (about 6e-5 for a weight of 0.02) is lost; early in a run, under learning-rate
warm-up, almost all of them are, and an ESM-2 650M run trailed fp32 master weights by 0.52 in loss at step 10
(docs/benchmarks.md). There ``CompensatedAdamW`` (compensated_adamw.py) keeps the 16 low bits of each weight's fp32
master value beside it (2 bytes per parameter) and follows fp32 AdamW; ``compensate_bf16_updates: false`` restores
torch's AdamW.

With fp32 master weights held in the optimizer (``mixed_precision.masters_in_optimizer``: bf16 weights and their low
bits, mixed_precision.py) it is ``CompensatedAdamW`` with float32 moments, its low bits those of the float32 weights
the model was built with (``master_low_bits``, from ``compensated_adamw.split_float32_masters``), on CPU and CUDA.

With fp32 weights (fp32 master weights, the default, or no bf16 compute) on CUDA it is ``CompensatedAdamW`` too, whose
float32 parameters get plain AdamW in the same Triton kernel: torch's AdamW arithmetic in float32, as torch's fused
AdamW computes it, and a step that takes gradient clipping's factor (``grad_clipping.clip_grad_norm_and_step``), so
the fp32 gradients are not first rewritten in place (a read and a write of 8 bytes per parameter: 5.2 GB per ESM-2
650M step). The clipped gradient is the same float32 product either way. ``adamw_kwargs`` with any other
``torch.optim.AdamW`` argument (``+adamw_kwargs.fused=true``, ``amsgrad``, ``foreach``, ...) gets torch's AdamW
instead, fused on CUDA unless ``fused`` says otherwise; so does every run on the CPU.

Megatron-FSDP (``train_mfsdp.py``) shards the optimizer built here together with the model, inside
``megatron_fsdp_init_step_left_out`` (below): its ``fully_shard`` runs one optimizer step on zero gradients to build
the state, which that context turns into a step that changes nothing and counts nothing. The optimizer there is the
one chosen here, over Megatron-FSDP's shards: its fp32 main weights, or its bf16 shards with bf16 weights
(``mixed_precision.megatron_fsdp_precision``).
"""

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from compensated_adamw import CompensatedAdamW
from mixed_precision import computes_in_bf16, holds_masters_in_optimizer, keeps_fp32_master_weights
from user_errors import ConfigError


logger = logging.getLogger(__name__)

# The adamw_kwargs CompensatedAdamW accepts (torch's AdamW also takes amsgrad, maximize, foreach, ...).
COMPENSATED_ADAMW_KWARGS = ("lr", "betas", "eps", "weight_decay")


def updates_bf16_weights_compensated(cfg, device: torch.device) -> bool:
    """Whether this run's weights are bf16 and their optimizer keeps the low bits (``CompensatedAdamW``)."""
    mp_cfg = cfg.mixed_precision
    if holds_masters_in_optimizer(mp_cfg, device):
        return True
    bf16_weights = computes_in_bf16(mp_cfg, device) and not keeps_fp32_master_weights(mp_cfg, device)
    return bf16_weights and bool(mp_cfg.compensate_bf16_updates)


def build_adamw(
    params: Iterable, cfg, device: torch.device, master_low_bits: dict | None = None
) -> torch.optim.Optimizer:
    """AdamW with ``cfg.adamw_kwargs`` over ``params`` (parameters or parameter groups) for a model on ``device``;
    ``master_low_bits``: the low halves of the float32 weights a ``masters_in_optimizer`` model was built from."""
    masters_in_optimizer = holds_masters_in_optimizer(cfg.mixed_precision, device)
    if updates_bf16_weights_compensated(cfg, device):
        unsupported = sorted(set(cfg.adamw_kwargs) - set(COMPENSATED_ADAMW_KWARGS))
        if unsupported:
            setting = "masters_in_optimizer" if masters_in_optimizer else "compensate_bf16_updates"
            raise ConfigError(
                f"adamw_kwargs.{unsupported[0]} is not supported with "
                f"{'' if masters_in_optimizer else 'bf16 weights and '}mixed_precision.{setting}=true "
                f"(CompensatedAdamW takes {', '.join(COMPENSATED_ADAMW_KWARGS)}): remove it, or set "
                f"mixed_precision.{setting}=false"
            )
        if masters_in_optimizer:
            if master_low_bits is None:
                raise ValueError("masters_in_optimizer: build_adamw needs the model's master_low_bits")
            logger.info(
                "Optimizer: CompensatedAdamW, fp32 master weights held as the bf16 weights and their 16 low bits, "
                "float32 moments"
            )
            return CompensatedAdamW(
                params, **cfg.adamw_kwargs, state_dtype=torch.float32, initial_compensation=master_low_bits
            )
        logger.info("Optimizer: CompensatedAdamW (bf16 weights with the 16 low bits of their fp32 master values)")
        return CompensatedAdamW(params, **cfg.adamw_kwargs)
    if device.type == "cuda" and set(cfg.adamw_kwargs) <= set(COMPENSATED_ADAMW_KWARGS):
        logger.info(
            "Optimizer: CompensatedAdamW's float32 kernel (torch's AdamW arithmetic; gradient clipping's factor "
            "applied in the step; +adamw_kwargs.fused=true selects torch's fused AdamW)"
        )
        return CompensatedAdamW(params, **cfg.adamw_kwargs)
    kwargs = {"fused": device.type == "cuda", **cfg.adamw_kwargs}
    logger.info("Optimizer: torch.optim.AdamW (fused=%s)", kwargs["fused"])
    return torch.optim.AdamW(params, **kwargs)


# The state an AdamW step sets from its gradients: Megatron-FSDP's zero-gradient step sets the step count to 1 and the
# moments to zero. (CompensatedAdamW's low bits are not among them: a step at learning rate 0 leaves them as they were.)
_STEP_STATE = ("step", "exp_avg", "exp_avg_sq")


@contextlib.contextmanager
def megatron_fsdp_init_step_left_out(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around ``megatron_fsdp.fully_shard(model, optimizer, ...)``: leave out the optimizer step it takes to build
    the optimizer's state (so that a checkpoint load finds state to load into).

    That step runs on zero gradients at the configured learning rate. It would decay every weight once by
    ``lr * weight_decay`` and count as AdamW's first step, so the first step of training would be bias-corrected as a
    second one: an update about a quarter smaller than torch's AdamW makes (betas 0.9/0.98: 0.74 of it), and every
    early step off the DDP and FSDP2 runs'. Here the step runs at learning rate 0 (``fully_shard`` builds the new
    parameter group from the optimizer's defaults), changing no weight, and afterwards the learning rate is restored
    and each parameter's step count and moments are zeroed: training's first step is AdamW's first.
    """
    lr = optimizer.defaults["lr"]
    optimizer.defaults["lr"] = 0.0
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        optimizer.defaults["lr"] = lr
        for group in optimizer.param_groups:
            group["lr"] = lr
    for state in optimizer.state.values():
        for key in _STEP_STATE:
            if key in state:
                state[key].zero_()
