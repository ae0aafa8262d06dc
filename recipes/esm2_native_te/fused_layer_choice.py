# Copied from common/fused_layer_choice.py — edit the source, then run ci/check_copies.py --fix
"""Where a recipe run may build ``FusedResidualTransformerLayer`` (fused_residual_layer.py) and where it falls back.

The L1 configs of ESM-2, AMPLIFY and Llama turn on ``fused_residual_norm`` (faster on one GPU: docs/benchmarks.md).
Those layers compute in bf16/fp32 only, do not split attention over a context-parallel group and do not run under
torch.compile. A run that adds any of these to such a config gets TE's layers instead, with one warning that says
why, so that ``fp8_config.enabled=true`` or ``cp_size=2`` on top of an L1 config just works. (Built directly, the
models refuse these combinations with a ValueError.)
"""

import logging


logger = logging.getLogger(__name__)


def keep_fused_layers_only_where_they_run(cfg, config) -> None:
    """Switch ``config.fused_residual_norm`` off (with a warning) when run config ``cfg`` asks for FP8/FP4 layers
    (``config.layer_precision``, already resolved), ``cp_size > 1`` or ``use_torch_compile``."""
    if not getattr(config, "fused_residual_norm", False):
        return
    reasons = []
    if any(precision is not None for precision in config.layer_precision or []):
        reasons.append("this run has FP8/FP4 layers and the fused layers compute in bf16/fp32 only")
    if cfg.get("cp_size", 1) > 1:
        reasons.append("cp_size > 1 and the fused layers do not split attention over a context-parallel group")
    if cfg.get("use_torch_compile", False):
        reasons.append("use_torch_compile=true and the fused layers do not run under torch.compile")
    if reasons:
        logger.warning("fused_residual_norm is off for this run (TE's layers instead): %s", "; ".join(reasons))
        config.fused_residual_norm = False
