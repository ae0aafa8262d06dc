"""The two protein language models this recipe trains, ESM-2 and AMPLIFY, and how to tell which one a model is.

``model_tag``'s config.json decides, so the same entrypoints and Hydra configs train either:

- ESM-2: an NVEsm config or export (``architectures: [NVEsm...]``, ``model_configs/esm2_*``), or a stock Hugging
  Face ESM-2 checkpoint (``model_type: esm``), converted on load;
- AMPLIFY: an NVAmplify config or export (``architectures: [NVAmplify...]``, ``model_configs/AMPLIFY_*``), or a
  published AMPLIFY checkpoint (chandar-lab's layout, ``model_type: AMPLIFY``), converted on load.

Both NV models take the same batches (BSHD or THD, labels for masked-LM) and have the same training-time hooks
(``init_empty_weights``, ``set_context_parallel_group`` on the encoder). They differ in where the encoder and its layers
sit, which is all the rest of the recipe needs to know: :class:`ModelFamily` says it, and picks each family's
tokenizer (``tokenizer_path: auto``). ``load_model_config`` and ``load_pretrained_state_dict`` turn a run's config
(``model_tag``, ``model_config_overrides``, ``init_from_pretrained``) into the model config and weights to train.
"""

import logging

import torch
from convert import convert_esm_hf_to_te, nv_config_from_hf
from convert_amplify import convert_amplify_hf_to_te, load_published_checkpoint, nv_config_from_published
from fused_layer_choice import keep_fused_layers_only_where_they_run
from modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM
from modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM
from omegaconf import DictConfig, OmegaConf
from quantization import (
    QuantizationPlan,
    build_quantization,
    check_quantized_gemm_shapes,
)
from recipe_paths import looks_like_hub_id, model_directory, recipe_path, tokenizer_source
from transformers import AutoTokenizer, EsmConfig, EsmForMaskedLM, PretrainedConfig, PreTrainedTokenizerBase
from user_errors import ConfigError, PathNotFoundError


logger = logging.getLogger(__name__)


class ModelFamily:
    """What differs between the model families; ``stock`` is True for a checkpoint in its original authors' layout."""

    name: str
    model_class: type
    tokenizer_dir: str  # this recipe's tokenizer for the family (``tokenizer_path: auto``)

    def __init__(self, stock: bool):
        self.stock = stock

    def load_config(self, source: str, **overrides):
        """The NV config of ``source`` with ``overrides`` (names of its fields) applied."""
        raise NotImplementedError

    def load_weights(self, source: str) -> torch.nn.Module:
        """The NV model holding ``source``'s weights, on the CPU, in float32, with the torch backend."""
        raise NotImplementedError

    @staticmethod
    def encoder(model: torch.nn.Module) -> torch.nn.Module:
        """The encoder of the masked-LM model (it takes the context-parallel group)."""
        raise NotImplementedError

    @staticmethod
    def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer layers of the masked-LM model (one FSDP unit each)."""
        raise NotImplementedError

    @staticmethod
    def validate(config) -> None:
        """Fail on settings the model cannot run (called again once the precision plan is set)."""
        raise NotImplementedError


class Esm2(ModelFamily):
    name = "ESM-2"
    model_class = NVEsmForMaskedLM
    tokenizer_dir = "tokenizer"

    def load_config(self, source: str, **overrides) -> NVEsmConfig:
        if self.stock:
            return nv_config_from_hf(EsmConfig.from_pretrained(source), **overrides)
        return NVEsmConfig.from_pretrained(source, **overrides)

    def load_weights(self, source: str) -> NVEsmForMaskedLM:
        if self.stock:
            return convert_esm_hf_to_te(EsmForMaskedLM.from_pretrained(source, dtype=torch.float32), backend="torch")
        return NVEsmForMaskedLM.from_pretrained(source, backend="torch", dtype=torch.float32)

    @staticmethod
    def encoder(model: NVEsmForMaskedLM) -> torch.nn.Module:
        return model.esm

    @staticmethod
    def transformer_layers(model: NVEsmForMaskedLM) -> torch.nn.ModuleList:
        return model.esm.encoder.layers

    @staticmethod
    def validate(config: NVEsmConfig) -> None:
        config.validate_nv_esm()


class Amplify(ModelFamily):
    name = "AMPLIFY"
    model_class = NVAmplifyForMaskedLM
    tokenizer_dir = "tokenizer_amplify"

    def load_config(self, source: str, **overrides) -> NVAmplifyConfig:
        if self.stock:
            return nv_config_from_published(PretrainedConfig.get_config_dict(source)[0], **overrides)
        return NVAmplifyConfig.from_pretrained(source, **overrides)

    def load_weights(self, source: str) -> NVAmplifyForMaskedLM:
        if not self.stock:
            return NVAmplifyForMaskedLM.from_pretrained(source, backend="torch", dtype=torch.float32)
        try:
            state_dict, config = load_published_checkpoint(source)
        except FileNotFoundError as error:  # e.g. sharded weights, which the published checkpoints never are
            raise PathNotFoundError(f"model_tag {source}: {error}") from None
        try:
            model = convert_amplify_hf_to_te(state_dict, config, backend="torch")
        except ValueError as error:  # missing or extra weights, named
            raise ConfigError(f"model_tag {source}: {error}") from None
        return model.float()

    @staticmethod
    def encoder(model: NVAmplifyForMaskedLM) -> torch.nn.Module:
        return model.amplify

    @staticmethod
    def transformer_layers(model: NVAmplifyForMaskedLM) -> torch.nn.ModuleList:
        return model.amplify.layers

    @staticmethod
    def validate(config: NVAmplifyConfig) -> None:
        config.validate_nv_amplify()


def model_source(cfg: DictConfig) -> str:
    """``model_tag`` as a local directory when one exists (recipe-relative paths included), else as a Hub id."""
    if recipe_path(cfg.model_tag).exists() or not looks_like_hub_id(str(cfg.model_tag)):
        # A local directory must be complete: Transformers would build a default model from one without config.json.
        return str(model_directory(cfg.model_tag, weights=cfg.init_from_pretrained))
    return str(cfg.model_tag)


def family_of(source: str) -> ModelFamily:
    """The family of the model whose config.json is in ``source`` (a directory or Hub id)."""
    config = PretrainedConfig.get_config_dict(source)[0]
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if any(name.startswith("NVAmplify") for name in architectures):
        return Amplify(stock=False)
    if any(name.startswith("NVEsm") for name in architectures) or model_type == "nv_esm":  # nv_esm: older exports
        return Esm2(stock=False)
    if model_type == "esm":
        return Esm2(stock=True)
    if str(model_type).lower() == "amplify":
        return Amplify(stock=True)
    raise ConfigError(
        f"model_tag {source} holds a {model_type!r} model, not ESM-2 ('esm') or AMPLIFY: point it at one of "
        "this recipe's model_configs/, an export of this recipe, or a stock ESM-2 / published AMPLIFY checkpoint"
    )


def load_tokenizer(cfg: DictConfig) -> PreTrainedTokenizerBase:
    """The tokenizer for the model in ``model_tag``: ``cfg.tokenizer_path``, or with ``auto`` the recipe's tokenizer
    for the model's family. It must have the model's vocabulary: an ESM-2 tokenizer would feed an AMPLIFY model token
    ids that mean other residues, and training would run on without a word."""
    source = model_source(cfg)
    family = family_of(source)
    path = family.tokenizer_dir if cfg.tokenizer_path == "auto" else cfg.tokenizer_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(path))
    config = family.load_config(source)
    expected = {
        "vocabulary size": config.vocab_size,
        "<pad> id": config.pad_token_id,
        "<mask> id": config.mask_token_id,
    }
    found = {
        "vocabulary size": len(tokenizer),
        "<pad> id": tokenizer.pad_token_id,
        "<mask> id": tokenizer.mask_token_id,
    }
    wrong = [f"{name} {found[name]} (model: {value})" for name, value in expected.items() if found[name] != value]
    if wrong:
        raise ConfigError(
            f"tokenizer_path={path} does not fit the {family.name} model in {source}: {', '.join(wrong)}; "
            f"use tokenizer_path=auto (this recipe's {family.tokenizer_dir}/) or the model's own tokenizer"
        )
    logger.info("Tokenizer: %s (%d tokens) for %s", path, len(tokenizer), family.name)
    return tokenizer


PRETRAINED_MISMATCH = (
    "the model_tag weights do not fit this model: drop the model_config_overrides that change its shape"
)


def load_model_config(cfg: DictConfig, fp8_config, fp4_config) -> tuple[PretrainedConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, and the per-layer FP8/FP4 plan the model needs
    (``fp8_config``/``fp4_config``: the mappings ``quantization.build_quantization`` reads)."""
    source = model_source(cfg)
    family = family_of(source)
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(family.load_config(source).to_dict()))
    if unknown:
        raise ConfigError(
            f"model_config_overrides has keys {unknown} that {source}/config.json does not have; check their spelling"
        )
    config = family.load_config(source, **overrides)
    if fp8_config["enabled"] or fp4_config["enabled"]:  # a shape problem first: it holds on every machine
        # AMPLIFY's FFN width is intermediate_size * 2/3 rounded up to a multiple of 8, so a shape that looks round
        # can still miss: 1280 gives 856.
        ffn_width = getattr(config, "ffn_hidden_size", config.intermediate_size)
        check_quantized_gemm_shapes(
            {"hidden_size": config.hidden_size, "FFN width": ffn_width},
            f" (intermediate_size {config.intermediate_size})",
        )
    plan = build_quantization(fp8_config, fp4_config, config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    keep_fused_layers_only_where_they_run(cfg, config)  # FP4/MXFP8, CP or compile: TE's layers, one warning
    try:
        family.validate(config)
    except ValueError as error:
        raise ConfigError(f"{error}: change model_config_overrides") from None
    return config, plan


def load_pretrained_state_dict(cfg: DictConfig) -> dict[str, torch.Tensor] | None:
    """Full (CPU, float32) weights from ``model_tag`` when ``init_from_pretrained`` is set, else None."""
    if not cfg.init_from_pretrained:
        return None
    source = model_source(cfg)
    model = family_of(source).load_weights(source)
    logger.info("Fine-tuning from the weights in %s", source)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
