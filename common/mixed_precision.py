"""The one mixed-precision rule of every recipe: when to compute in bf16, and the FSDP2 policy that does it.

The config group (see ``hydra_config/defaults.yaml``)::

    mixed_precision: {enabled, fp32_master_weights, on_cpu[, masters_in_optimizer]}

bf16 compute runs on CUDA when ``enabled``, and on CPU only with ``on_cpu`` (tests). With fp32 master weights
(the default) the sharded parameters and the optimizer state stay fp32 and FSDP2 casts each layer's gathered
parameters to bf16 for compute; gradients are reduced in fp32. Without them the model itself is cast to bf16, and its
gradients are bf16 (accumulated and reduced in bf16) under DDP, FSDP2 and Megatron-FSDP alike.

``masters_in_optimizer`` (``train_ddp.py`` of the recipes whose config has the key) keeps fp32 master weights in
another place: the model holds each master value rounded to bf16, and ``CompensatedAdamW`` the 16 low bits that
restore it exactly, with float32 moments, so the optimizer runs float32 AdamW on the float32 masters as before. The
GEMMs then read the bf16 weights as they are, instead of a bf16 copy cast from the fp32 weight before each of them;
the weight gradients are rounded to bf16 once (as FSDP2's bf16 compute copies round them) and DDP averages them in
float32 (``distributed.wrap_in_ddp``). +0.7-2.4% on one H100 for Llama 1B and AMPLIFY 350M (docs/benchmarks.md).
"""

import logging

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from user_errors import ConfigError


logger = logging.getLogger(__name__)


def computes_in_bf16(mp_cfg, device: torch.device) -> bool:
    """Whether this run computes in bf16 on ``device`` (``mp_cfg`` is the ``mixed_precision`` config group)."""
    return bool(mp_cfg.enabled) and (device.type == "cuda" or bool(mp_cfg.on_cpu))


def keeps_fp32_master_weights(mp_cfg, device: torch.device) -> bool:
    """bf16 compute from fp32 parameters (cast per layer by FSDP2 or autocast), rather than a bf16 model."""
    return (
        computes_in_bf16(mp_cfg, device)
        and bool(mp_cfg.fp32_master_weights)
        and not holds_masters_in_optimizer(mp_cfg, device)
    )


def holds_masters_in_optimizer(mp_cfg, device: torch.device) -> bool:
    """fp32 master weights held as a bf16 model plus each weight's 16 low bits in ``CompensatedAdamW`` (float32
    moments): ``mixed_precision.masters_in_optimizer`` (see the module docstring)."""
    return (
        computes_in_bf16(mp_cfg, device)
        and bool(mp_cfg.fp32_master_weights)
        and bool(mp_cfg.get("masters_in_optimizer", False))
    )


def settle_masters_in_optimizer(cfg, strategy: str, device: torch.device) -> None:
    """Check ``mixed_precision.masters_in_optimizer`` for ``strategy`` (the recipe's word for its entrypoint: "ddp",
    "fsdp2", "mfsdp") before the model is built.

    FSDP2 and Megatron-FSDP keep fp32 master weights their own way (fp32 shards, cast to bf16 per layer), so there
    the setting does not apply: it is switched off in ``cfg`` (logged), and a config that sets it for ``train_ddp.py``
    runs with those entrypoints too. Under DDP it needs one micro-batch per step: the bf16 gradients of several
    would add up in bf16, where fp32 master weights add them in float32 (``ConfigError``).
    """
    if not holds_masters_in_optimizer(cfg.mixed_precision, device):
        return
    if strategy != "ddp":
        logger.info(
            "mixed_precision.masters_in_optimizer is for train_ddp.py; %s keeps its fp32 master weights itself",
            strategy,
        )
        cfg.mixed_precision.masters_in_optimizer = False
        return
    if int(cfg.grad_acc_steps) > 1:
        raise ConfigError(
            f"mixed_precision.masters_in_optimizer=true needs grad_acc_steps=1 (got {cfg.grad_acc_steps}): its bf16 "
            "gradients would be summed over the micro-batches in bf16. Set mixed_precision.masters_in_optimizer=false "
            "to accumulate fp32 gradients"
        )


def mixed_precision_policy(mp_cfg, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's policy: fp32 master weights cast to bf16 per layer for compute, gradients reduced in fp32.

    ``cast_forward_inputs=False`` always: FSDP2 would otherwise cast every floating-point argument of a sharded
    layer to bf16, including the rotary-embedding table the model hands to each layer. RoPE angles need fp32 at
    long positions (bf16 keeps 8 bits of mantissa: the angle at position 8,000 would be off by whole radians), and
    the layers cast their own activations anyway.
    """
    if keeps_fp32_master_weights(mp_cfg, device):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def megatron_fsdp_precision(mp_cfg, device: torch.device) -> tuple[torch.dtype | None, torch.dtype | None]:
    """Megatron-FSDP's ``(main_params_dtype, main_grads_dtype)`` for this run (its ``MixedPrecisionPolicy``).

    fp32 main weights and fp32 main gradients (accumulated and reduced in fp32), except for bf16 weights
    (``fp32_master_weights: false`` with bf16 compute): there ``(None, None)``, so the bf16 compute weights are what
    the optimizer updates (``CompensatedAdamW`` keeps their low bits) and the gradients are bf16, as FSDP2's and DDP's
    are for a bf16 model. fp32 main gradients would not do there: Megatron-FSDP (0.6) hands them to the bf16
    parameters uncast, and torch refuses the assignment in the first backward pass (seen on an H200, torch 2.11).
    """
    bf16_weights = computes_in_bf16(mp_cfg, device) and not keeps_fp32_master_weights(mp_cfg, device)
    return (None, None) if bf16_weights else (torch.float32, torch.float32)
