"""Where a recipe run may build ``FusedResidualTransformerLayer`` (fused_residual_layer.py) and where it falls back.

The L1 configs of ESM-2, AMPLIFY and Llama turn on ``fused_residual_norm`` (faster on one GPU: docs/benchmarks.md).
Those layers compute in the precisions their model's config lists in ``fused_residual_norm_precisions`` (bf16/fp32,
and FP8 with DelayedScaling, Float8CurrentScaling or Float8BlockScaling), do not split attention over a
context-parallel group and do not run under torch.compile. A run that adds anything else to such a config (FP4
layers, MXFP8, ``cp_size > 1``, torch.compile) gets TE's layers instead, with one warning that says why, so that
``fp4_config.enabled=true`` or ``cp_size=2`` on top of an L1 config just works. (Built directly, the models refuse
these combinations with a ValueError.)
"""

import logging


try:  # package import
    from .fused_residual_layer import FP8_RECIPES
except ImportError:  # flat copy inside a recipe folder
    from fused_residual_layer import FP8_RECIPES


logger = logging.getLogger(__name__)


def keep_fused_layers_only_where_they_run(cfg, config) -> None:
    """Switch ``config.fused_residual_norm`` off (with a warning) when run config ``cfg`` asks for layer precisions
    (``config.layer_precision``, already resolved) or an FP8 recipe the fused layers do not compute in,
    ``cp_size > 1`` or ``use_torch_compile``."""
    if not getattr(config, "fused_residual_norm", False):
        return
    reasons = []
    supported = getattr(config, "fused_residual_norm_precisions", (None,))
    precisions = set(config.layer_precision or [])
    if precisions - set(supported):
        reasons.append(
            f"this run has {'/'.join(sorted(str(p).upper() for p in precisions - set(supported)))} layers and this "
            f"model's fused layers compute in {', '.join('bf16/fp32' if p is None else p.upper() for p in supported)}"
        )
    fp8_recipe = str((cfg.get("fp8_config") or {}).get("fp8_recipe", "")).rsplit(".", 1)[-1]
    if "fp8" in precisions and "fp8" in supported and fp8_recipe not in FP8_RECIPES:
        reasons.append(f"the fused layers run FP8 with {', '.join(FP8_RECIPES)}, not {fp8_recipe}")
    if cfg.get("cp_size", 1) > 1:
        reasons.append("cp_size > 1 and the fused layers do not split attention over a context-parallel group")
    if cfg.get("use_torch_compile", False):
        reasons.append("use_torch_compile=true and the fused layers do not run under torch.compile")
    if reasons:
        logger.warning("fused_residual_norm is off for this run (TE's layers instead): %s", "; ".join(reasons))
        config.fused_residual_norm = False
