"""The model the Trainer trains: this recipe's ESM-2/AMPLIFY (``model_implementation: nv``) or the stock Hugging Face
EsmForMaskedLM (``hf``, the baseline).

``model_tag`` is a directory (or Hub id) with a ``config.json``: one of ``model_configs/`` to pre-train from random
weights, an export of this recipe, a stock ESM-2 checkpoint or a published AMPLIFY one (``model_families.py`` tells
them apart). ``init_from_pretrained: true`` loads its weights too (stock checkpoints are converted): fine-tuning.

The model is built whole on every process from the same seed; ``accelerate`` then places it and wraps it (DDP) or
shards it (FSDP2) as its config file says.
"""

import logging
from dataclasses import dataclass

import torch
from model_families import PRETRAINED_MISMATCH, family_of, load_model_config, load_pretrained_state_dict, model_source
from modeling_esm_te import resolve_backend  # the same function in both modeling files: is TE usable here?
from omegaconf import DictConfig
from perf_logger import ModelFlops
from quantization import QuantizationPlan, check_quantization_supported
from transformers import EsmConfig, EsmForMaskedLM, PretrainedConfig
from user_errors import ConfigError, UnsupportedHardwareError
from weight_conversion import load_state_dict_exactly


logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("nv", "hf")
NO_FP8 = NO_FP4 = {"enabled": False}


@dataclass
class BuiltModel:
    model: torch.nn.Module
    config: PretrainedConfig
    plan: QuantizationPlan
    model_flops: ModelFlops


def build_model(cfg: DictConfig, fp8_config: dict, device: torch.device) -> BuiltModel:
    """The model of this run, on ``device`` (TE layers are created there), initialised from the current RNG state
    or, with ``init_from_pretrained``, from the weights in ``model_tag``."""
    if cfg.model_implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"model_implementation must be one of {IMPLEMENTATIONS}, got {cfg.model_implementation!r}")
    if cfg.model_implementation == "hf":
        return _build_stock_esm(cfg)
    family = family_of(model_source(cfg))
    config, plan = load_model_config(cfg, fp8_config, NO_FP4)
    try:
        check_quantization_supported(plan, device)
    except UnsupportedHardwareError as error:
        raise UnsupportedHardwareError(
            f"the accelerate config's mixed_precision: fp8 cannot run here: {error}"
        ) from None
    try:
        resolve_backend(config.backend)  # backend=te on a machine without TE or a GPU fails here, in one line
    except RuntimeError as error:
        raise UnsupportedHardwareError(f"{error} (+model_config_overrides.backend=torch)") from None
    with torch.device(device):
        model = family.model_class(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    pretrained = load_pretrained_state_dict(cfg)
    if pretrained is not None:
        try:
            load_state_dict_exactly(model, pretrained, "the pretrained checkpoint")
        except ValueError as error:
            raise ConfigError(f"{error}; {PRETRAINED_MISMATCH}") from None
    if plan.enabled:
        logger.info("FP8 layers (1-indexed): %s", [i + 1 for i, p in enumerate(plan.layer_precision) if p == "fp8"])
    return _built(model, config, plan, f"{family.name}, {model.backend} backend")


def _build_stock_esm(cfg: DictConfig) -> BuiltModel:
    """transformers' own EsmForMaskedLM with the same shape (and weights, with init_from_pretrained)."""
    source = model_source(cfg)
    family = family_of(source)
    if family.name != "ESM-2":
        raise ConfigError(f"model_implementation=hf is the stock ESM-2; {source} holds an {family.name} model")
    if cfg.dataset.input_format != "bshd":
        raise ConfigError("model_implementation=hf takes padded batches only: set dataset.input_format=bshd")
    nv_config, plan = load_model_config(cfg, NO_FP8, NO_FP4)
    if family.stock:
        config = EsmConfig.from_pretrained(source)
        for key, value in cfg.model_config_overrides.items():
            setattr(config, key, value)
    else:
        config = EsmConfig(**{k: v for k, v in nv_config.to_dict().items() if k in EsmConfig().to_dict()})
        config.architectures = ["EsmForMaskedLM"]
    if cfg.init_from_pretrained:
        if not family.stock:
            raise ConfigError("model_implementation=hf fine-tunes stock ESM-2 checkpoints only (not NV exports)")
        model = EsmForMaskedLM.from_pretrained(source, config=config, dtype=torch.float32)
    else:
        model = EsmForMaskedLM(config)
    # The contact-prediction head takes no part in masked-LM training; as parameters it would leave DDP waiting for
    # gradients that never come. This recipe's model keeps it in buffers for the same reason.
    model.esm.contact_head.requires_grad_(False)
    return _built(model, config, plan, "ESM-2, stock Hugging Face EsmForMaskedLM")


def _built(model: torch.nn.Module, config: PretrainedConfig, plan: QuantizationPlan, what: str) -> BuiltModel:
    flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    logger.info("Model: %s, %.1fM parameters", what, sum(p.numel() for p in model.parameters()) / 1e6)
    return BuiltModel(model, config, plan, flops)
