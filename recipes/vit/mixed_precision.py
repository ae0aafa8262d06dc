# Copied from common/mixed_precision.py — edit the source, then run ci/check_copies.py --fix
"""The one mixed-precision rule of every recipe: when to compute in bf16, and the FSDP2 policy that does it.

The config group (see ``hydra_config/defaults.yaml``)::

    mixed_precision: {enabled, fp32_master_weights, on_cpu}

bf16 compute runs on CUDA when ``enabled``, and on CPU only with ``on_cpu`` (tests). With fp32 master weights
(the default) the sharded parameters and the optimizer state stay fp32 and FSDP2 casts each layer's gathered
parameters to bf16 for compute; gradients are reduced in fp32. Without them the model itself is cast to bf16, and its
gradients are bf16 (accumulated and reduced in bf16) under DDP, FSDP2 and Megatron-FSDP alike.
"""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


def computes_in_bf16(mp_cfg, device: torch.device) -> bool:
    """Whether this run computes in bf16 on ``device`` (``mp_cfg`` is the ``mixed_precision`` config group)."""
    return bool(mp_cfg.enabled) and (device.type == "cuda" or bool(mp_cfg.on_cpu))


def keeps_fp32_master_weights(mp_cfg, device: torch.device) -> bool:
    """bf16 compute from fp32 parameters (cast per layer by FSDP2 or autocast), rather than a bf16 model."""
    return computes_in_bf16(mp_cfg, device) and bool(mp_cfg.fp32_master_weights)


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
