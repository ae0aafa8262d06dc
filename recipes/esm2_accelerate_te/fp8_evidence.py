"""Proof that FP8 really ran: TransformerEngine records the absolute maximum (amax) of every tensor it casts to FP8
with delayed scaling. After training, a module whose amax history is still all zero never ran an FP8 GEMM.

An FP8 run that silently trained in bf16 (for example because ``bf16=True`` overrode accelerate's ``fp8``) would
show 0 here; train.py logs the count and writes it into summary.json as ``fp8_modules_with_amax``.
"""

import torch


def count_modules_with_fp8_amax(model: torch.nn.Module) -> int:
    """TE modules whose forward FP8 amax history holds a non-zero value (DelayedScaling; 0 for other recipes)."""
    count = 0
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        state = meta.get("scaling_fwd")
        history = getattr(state, "amax_history", None)
        if isinstance(history, torch.Tensor) and history.numel() and bool((history != 0).any()):
            count += 1
    return count
