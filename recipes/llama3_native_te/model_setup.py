"""What every entrypoint needs before it builds the model: recipe-relative paths, the model config with this run's
overrides and its per-layer FP8/FP4 plan, and the name of the Hydra config that is running."""

from pathlib import Path

import hydra
from modeling_llama_te import NVLlamaConfig
from omegaconf import DictConfig, OmegaConf
from quantization import QuantizationPlan, build_quantization


RECIPE_DIR = Path(__file__).resolve().parent


def recipe_path(path: str) -> Path:
    """A path as given when it exists from the working directory, else relative to this recipe folder."""
    return Path(path) if Path(path).exists() or Path(path).is_absolute() else RECIPE_DIR / path


def load_model_config(cfg: DictConfig) -> tuple[NVLlamaConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, and the per-layer FP8/FP4 plan the model needs."""
    model_dir = recipe_path(cfg.model_tag)
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(NVLlamaConfig.from_pretrained(model_dir).to_dict()))
    if unknown:
        raise ValueError(f"model_config_overrides has keys {unknown} that {model_dir}/config.json does not have")
    config = NVLlamaConfig.from_pretrained(model_dir, **overrides)
    fp8_config, fp4_config = OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
    plan = build_quantization(fp8_config, fp4_config, config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    config.validate_nv_llama()
    return config, plan


def config_name() -> str:
    """The Hydra config this run started from (recorded in summary.json)."""
    return hydra.core.hydra_config.HydraConfig.get().job.config_name


def pad_token_id(tokenizer) -> int:
    """What padding looks like in a batch: the tokenizer's pad token, or ``<eos>`` for tokenizers without one."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
