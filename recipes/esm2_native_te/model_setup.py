"""What every entrypoint needs around building the model: recipe-relative paths, the model config with this run's
overrides and its per-layer FP8/FP4 plan, pretrained weights to fine-tune from, and the running config's name.

``model_tag`` is a directory (or Hugging Face Hub id) holding a ``config.json``: one of this recipe's
``model_configs/`` to pre-train from scratch, an NVEsm export, or a stock Hugging Face ESM-2 checkpoint. With
``init_from_pretrained: true`` its weights are loaded too (stock checkpoints are converted on the fly).
"""

import logging
from pathlib import Path

import hydra
import torch
from convert import _load_exactly, convert_esm_hf_to_te, nv_config_from_hf
from modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM
from omegaconf import DictConfig, OmegaConf
from quantization import QuantizationPlan, build_quantization
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import EsmConfig, EsmForMaskedLM, PretrainedConfig


logger = logging.getLogger(__name__)


RECIPE_DIR = Path(__file__).resolve().parent


def recipe_path(path: str) -> Path:
    """A path as given when it exists from the working directory, else relative to this recipe folder."""
    return Path(path) if Path(path).exists() or Path(path).is_absolute() else RECIPE_DIR / path


def model_source(cfg: DictConfig) -> str:
    """``model_tag`` as a local directory when one exists (recipe-relative paths included), else as a Hub id."""
    local = recipe_path(cfg.model_tag)
    return str(local) if local.exists() else str(cfg.model_tag)


def _is_stock_esm(source: str) -> bool:
    model_type = PretrainedConfig.get_config_dict(source)[0].get("model_type")
    if model_type not in ("esm", "nv_esm"):
        raise ValueError(f"model_tag {source} holds a {model_type!r} model, not ESM-2 ('esm' or 'nv_esm')")
    return model_type == "esm"


def load_model_config(cfg: DictConfig) -> tuple[NVEsmConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, and the per-layer FP8/FP4 plan the model needs."""
    source = model_source(cfg)
    stock = _is_stock_esm(source)
    base = nv_config_from_hf(EsmConfig.from_pretrained(source)) if stock else NVEsmConfig.from_pretrained(source)
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(base.to_dict()))
    if unknown:
        raise ValueError(f"model_config_overrides has keys {unknown} that {source}/config.json does not have")
    if stock:
        config = nv_config_from_hf(EsmConfig.from_pretrained(source), **overrides)
    else:
        config = NVEsmConfig.from_pretrained(source, **overrides)
    fp8_config, fp4_config = OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
    plan = build_quantization(fp8_config, fp4_config, config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    config.validate_nv_esm()
    return config, plan


def load_pretrained_state_dict(cfg: DictConfig) -> dict[str, torch.Tensor] | None:
    """Full (CPU, float32) weights from ``model_tag`` when ``init_from_pretrained`` is set, else None."""
    if not cfg.init_from_pretrained:
        return None
    source = model_source(cfg)
    if _is_stock_esm(source):
        hf_model = EsmForMaskedLM.from_pretrained(source, dtype=torch.float32)
        model = convert_esm_hf_to_te(hf_model, backend="torch")
    else:
        model = NVEsmForMaskedLM.from_pretrained(source, backend="torch", dtype=torch.float32)
    logger.info("Fine-tuning from the weights in %s", source)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def apply_pretrained_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Copy ``state`` into ``model``, whole or FSDP2-sharded; every weight must be there with its shape."""
    if state is None:
        return
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        _load_exactly(model, state, "the pretrained checkpoint")
        return
    result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"cannot load the pretrained checkpoint: missing keys {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def config_name() -> str:
    """The Hydra config this run started from (recorded in summary.json)."""
    return hydra.core.hydra_config.HydraConfig.get().job.config_name
