"""Optional FP8/FP4 tensor statistics (underflows, scaling-factor ranges) from TransformerEngine's debug tools.

TE reads its debug configuration when its first layer is built, so ``QuantStats.start`` must run before the model
is constructed; ``watch`` then names the model's layers (the names in the logs), ``step`` closes each training
step and ``close`` flushes the logs. With ``quant_stats.enabled: false`` (the default) every call does nothing.
Needs TransformerEngine and ``nvidia-dlframework-inspect`` (``pip install nvdlfw-inspect``).
"""

import logging
from pathlib import Path

import torch


logger = logging.getLogger(__name__)
RECIPE_DIR = Path(__file__).resolve().parent


class QuantStats:
    def __init__(self, debug_api=None):
        self._debug_api = debug_api

    @classmethod
    def start(cls, quant_stats_cfg, output_dir: str | Path) -> "QuantStats":
        if not quant_stats_cfg.enabled:
            return cls()
        try:
            import nvdlfw_inspect.api as debug_api
            import transformer_engine
        except ImportError as error:
            raise RuntimeError(
                "quant_stats.enabled=true needs TransformerEngine and nvidia-dlframework-inspect "
                f"(pip install nvdlfw-inspect): {error}"
            ) from error
        config_file = Path(quant_stats_cfg.config_file)
        if not config_file.is_absolute() and not config_file.exists():
            config_file = RECIPE_DIR / config_file
        if not config_file.exists():
            raise FileNotFoundError(f"quant_stats.config_file {quant_stats_cfg.config_file} does not exist")
        log_dir = Path(output_dir) / "quant_stats"
        debug_api.initialize(
            config_file=str(config_file),
            feature_dirs=[str(Path(transformer_engine.__file__).parent / "debug" / "features")],
            log_dir=str(log_dir),
            default_logging_enabled=True,
        )
        logger.info("Logging quantized-tensor statistics (%s) to %s", config_file.name, log_dir)
        return cls(debug_api)

    def watch(self, model: torch.nn.Module) -> None:
        if self._debug_api is not None:
            self._debug_api.infer_and_assign_layer_names(model)

    def step(self) -> None:
        if self._debug_api is not None:
            self._debug_api.step()

    def close(self) -> None:
        if self._debug_api is not None:
            self._debug_api.end_debug()
            self._debug_api = None
