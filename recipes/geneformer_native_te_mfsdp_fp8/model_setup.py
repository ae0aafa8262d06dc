"""Building the model, the one way every entrypoint does it: config, tokenizer, precision plan, construction,
pretrained weights, sharding, init.

``model_tag`` is a directory (or Hugging Face Hub id) holding a ``config.json``: one of this recipe's
``model_configs/`` (Geneformer 10M, 106M, 4B) to pre-train from scratch, an export of this recipe, or a stock
Hugging Face ``BertForMaskedLM`` checkpoint such as a published Geneformer model (converted on load). With
``init_from_pretrained: true`` its weights are loaded too: fine-tuning.

``build_model(cfg, device, meshes, strategy)`` returns a :class:`BuiltModel`. Strategies:

- ``"ddp"``: the whole model on every rank, wrapped in ``DistributedDataParallel`` when a process group exists;
- ``"fsdp2"``: each transformer layer, then the root (embeddings, MLM head), sharded over ``meshes.fsdp`` with
  ``fully_shard`` and the one mixed-precision policy (``mixed_precision.mixed_precision_policy``); built on the
  meta device when ``fsdp.use_meta_device``, so each rank materialises only its own shards;
- ``"mfsdp"``: Megatron-FSDP (CUDA only) over the ``("dp", "tp")`` mesh in ``meshes.fsdp``. It shards the model and
  its optimizer together, so for this strategy the optimizer is built here too.

Every strategy's AdamW gets the parameter groups of ``weight_decay.weight_decay_groups``: no decay on biases and
LayerNorm weights, as in the Hugging Face Trainer that pretrained Geneformer.
"""

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from activation_recompute import recompute_note
from adamw import build_adamw, megatron_fsdp_init_step_left_out
from convert import convert_geneformer_hf_to_te, nv_config_from_hf
from distributed import Meshes, data_parallel_wrapper
from gene_tokenizer import build_gene_tokenizer
from mixed_precision import (
    computes_in_bf16,
    keeps_fp32_master_weights,
    megatron_fsdp_precision,
    mixed_precision_policy,
)
from modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM, resolve_backend
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops
from pretrained_weights import load_full_weights, weights_on_the_host
from quantization import (
    QuantizationPlan,
    build_quantization,
    check_quantization_supported,
    check_quantized_gemm_shapes,
)
from recipe_paths import looks_like_hub_id, model_directory, recipe_path, tokenizer_source
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, PretrainedConfig, PreTrainedTokenizerBase
from user_errors import ConfigError, UnsupportedHardwareError
from weight_decay import no_weight_decay_names, restore_weight_decay_groups, weight_decay_groups


logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2", "mfsdp")
PRETRAINED_MISMATCH = (
    "the model_tag weights do not fit this model: drop the model_config_overrides that change its shape"
)


# ----------------------------------------------------------------------------------------- config and weights


def model_source(cfg: DictConfig) -> str:
    """``model_tag`` as a local directory when one exists (recipe-relative paths included), else as a Hub id."""
    if recipe_path(cfg.model_tag).exists() or not looks_like_hub_id(str(cfg.model_tag)):
        return str(model_directory(cfg.model_tag, weights=cfg.init_from_pretrained))
    return str(cfg.model_tag)


def is_stock_bert(source: str, key: str = "model_tag") -> bool:
    """True for a stock ``BertForMaskedLM`` (published Geneformer), False for this project's config or export. ``key``
    is the config key that named ``source``, for the error message."""
    config = PretrainedConfig.get_config_dict(source)[0]
    if any(name.startswith("NVGeneformer") for name in config.get("architectures") or []):
        return False
    if config.get("model_type") == "bert":
        return True
    raise ConfigError(
        f"{key} {source} holds a {config.get('model_type')!r} model, not Geneformer (BERT): point it at one of "
        "this recipe's model_configs/, an export of this recipe, or a published Geneformer (BertForMaskedLM) checkpoint"
    )


def read_model_config(source: str, **overrides) -> NVGeneformerConfig:
    """The NV config of ``source`` with ``overrides`` applied and checked (``from_pretrained`` sets them after the
    config's own checks have run)."""
    if is_stock_bert(source):
        config = nv_config_from_hf(BertConfig.from_pretrained(source), **overrides)
    else:
        config = NVGeneformerConfig.from_pretrained(source, **overrides)
    if "vocab_size" in overrides and "padded_vocab_size" not in overrides:  # pad the new vocabulary, not the file's
        config.padded_vocab_size = 64 * math.ceil(config.vocab_size / 64)
    config.validate_nv_geneformer()
    return config


def load_model_config(cfg: DictConfig) -> tuple[NVGeneformerConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, and the per-layer FP8/FP4 plan the model needs."""
    source = model_source(cfg)
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(read_model_config(source).to_dict()))
    if unknown:
        raise ConfigError(
            f"model_config_overrides has keys {unknown} that {source}/config.json does not have; check their spelling"
        )
    try:
        config = read_model_config(source, **overrides)
    except ValueError as error:  # NVGeneformerConfig names every setting it cannot honour
        raise ConfigError(f"{error}: change model_config_overrides") from None
    fp8_config, fp4_config = OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
    if fp8_config["enabled"] or fp4_config["enabled"]:
        check_quantized_gemm_shapes({"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size})
    plan = build_quantization(fp8_config, fp4_config, config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    return config, plan


def load_tokenizer(cfg: DictConfig, config: NVGeneformerConfig) -> PreTrainedTokenizerBase:
    """``tokenizer_path``: ``auto`` (the export's own tokenizer if ``model_tag`` has one, else the id tokenizer of the
    model's vocabulary: cells are token ids), a tokenizer directory, or a gene token dictionary file (.pkl/.json).
    It must fit the model: its vocabulary size and <pad>/<mask> ids."""
    path = cfg.tokenizer_path
    if path == "auto":
        source = recipe_path(cfg.model_tag)
        if (source / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(source)
        else:
            tokenizer = build_gene_tokenizer(vocab_size=config.vocab_size)
    elif Path(str(path)).suffix in (".pkl", ".pickle", ".json") and recipe_path(path).is_file():
        try:
            tokenizer = build_gene_tokenizer(recipe_path(path))
        except ValueError as error:
            raise ConfigError(f"tokenizer_path={path}: {error}") from None
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(path))
    found = (len(tokenizer), tokenizer.pad_token_id, tokenizer.mask_token_id)
    expected = (config.vocab_size, config.pad_token_id, config.mask_token_id)
    if found != expected:
        raise ConfigError(
            f"tokenizer_path={path} does not fit the model: (vocabulary size, <pad> id, <mask> id) = {found}, the "
            f"model has {expected}; use a tokenizer or gene dictionary of the model's vocabulary"
        )
    return tokenizer


def load_pretrained_state_dict(cfg: DictConfig) -> dict[str, torch.Tensor] | None:
    """Full (CPU, float32) weights from ``model_tag`` when ``init_from_pretrained`` is set, else None."""
    if not cfg.init_from_pretrained:
        return None
    source = model_source(cfg)
    if is_stock_bert(source):
        model = convert_geneformer_hf_to_te(
            BertForMaskedLM.from_pretrained(source, dtype=torch.float32), backend="torch"
        )
    else:
        model = NVGeneformerForMaskedLM.from_pretrained(source, backend="torch", dtype=torch.float32)
    logger.info("Fine-tuning from the weights in %s", source)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def apply_pretrained_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Copy ``state`` into ``model``, whole or sharded (FSDP2, Megatron-FSDP: every rank its own part); every weight
    must be there with its shape."""
    if state is None:
        return
    try:
        load_full_weights(model, state, "the pretrained checkpoint")
    except ValueError as error:
        raise ConfigError(f"{error}; {PRETRAINED_MISMATCH}") from None


# ------------------------------------------------------------------------------------------------ the model


@dataclass
class BuiltModel:
    """What the entrypoints use of the model."""

    # Parameters for the optimizer, checkpoints and export: the bare model (DDP), sharded in place (FSDP2), or
    # Megatron-FSDP's wrapper (its ``.module`` is the model).
    model: torch.nn.Module
    train_model: torch.nn.Module  # what the loop calls: the DDP wrapper and/or torch.compile of ``model``
    config: NVGeneformerConfig
    tokenizer: PreTrainedTokenizerBase
    plan: QuantizationPlan
    model_flops: ModelFlops
    strategy: str
    ddp: DistributedDataParallel | None = None
    optimizer: torch.optim.Optimizer | None = None  # "mfsdp" only: sharded together with the model

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients in this backward (``enabled``) or only accumulate them locally (earlier micro-batches)."""
        if self.strategy == "fsdp2":
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if enabled:
            return contextlib.nullcontext()
        if self.strategy == "mfsdp":
            return self.model.no_sync()
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()


def build_model(cfg: DictConfig, device: torch.device, meshes: Meshes | None, strategy: str) -> BuiltModel:
    """The model of this run, built, placed (and sharded) for ``strategy``: initialised from ``cfg.seed``'s RNG, or
    with ``init_from_pretrained`` from the weights in ``model_tag``. ``meshes`` may be None for ``"ddp"``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    config, plan = load_model_config(cfg)
    tokenizer = load_tokenizer(cfg, config)
    check_quantization_supported(plan, device)  # FP8/FP4 on a machine that cannot run it fails here
    try:
        resolve_backend(config.backend)  # backend=te on a machine without TE or a GPU fails here, in one line
    except RuntimeError as error:
        raise UnsupportedHardwareError(f"{error} (+model_config_overrides.backend=torch)") from None
    pretrained = load_pretrained_state_dict(cfg)
    if strategy == "mfsdp":
        return _build_megatron_fsdp(cfg, device, meshes, config, tokenizer, plan, pretrained)

    on_meta = strategy == "fsdp2" and cfg.fsdp.use_meta_device
    with torch.device("meta" if on_meta else device):
        model = NVGeneformerForMaskedLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    if strategy == "ddp":
        apply_pretrained_weights(model, pretrained)
    if computes_in_bf16(cfg.mixed_precision, device) and not keeps_fp32_master_weights(cfg.mixed_precision, device):
        model.to(torch.bfloat16)  # bf16 weights and optimizer state: less memory, no fp32 master copy
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    _log_model(model)

    ddp = None
    if strategy == "fsdp2":
        policy = mixed_precision_policy(cfg.mixed_precision, device)
        reshard = cfg.fsdp.reshard_after_forward
        for layer in model.bert.encoder.layers:
            fully_shard(layer, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard)
        if on_meta:
            model.init_empty_weights(device)
        apply_pretrained_weights(model, pretrained)  # fine-tuning: every rank loads its own shards
        train_model = model
    else:
        # The same random init on every rank (same seed), and DDP broadcasts rank 0's weights anyway.
        ddp = data_parallel_wrapper(model, device)  # None for a process alone
        train_model = ddp or model
    if cfg.use_torch_compile:
        train_model = torch.compile(train_model)
    return BuiltModel(model, train_model, config, tokenizer, plan, model_flops, strategy, ddp)


def _build_megatron_fsdp(cfg, device, meshes, config, tokenizer, plan, pretrained) -> BuiltModel:
    """Megatron-FSDP: the model built whole on this GPU, then sharded together with its optimizer.

    Megatron-FSDP's meta-device path would initialise weights with each module's reset_parameters(), not the model's
    own initialisation, so it is not used. Its fp32 main weights live in its own sharded buffers, so the model itself is
    cast to bf16 whenever bf16 compute is on; with ``fp32_master_weights: false`` those bf16 weights are what trains.
    ``fully_shard`` builds those main weights from the bf16 model, so the float32 initialisation (or the pretrained
    weights) is loaded into them after sharding.
    """
    import megatron_fsdp

    with torch.device(device):
        model = NVGeneformerForMaskedLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    # fully_shard builds fp32 main weights from the model it is given, cast to bf16 below: the float32 initialisation
    # is kept on the host and loaded into them after sharding (pretrained weights are loaded there anyway). Built from
    # bf16 values, the first small updates would not move the bf16 compute weights (ESM-2 650M: loss 3.56 against
    # 3.25 at step 10; docs/benchmarks.md).
    keep_initialisation = pretrained is None and keeps_fp32_master_weights(cfg.mixed_precision, device)
    float32_init = weights_on_the_host(model) if keep_initialisation else None
    if cfg.mixed_precision.enabled:
        # bf16 compute weights beside fp32 main weights in Megatron-FSDP's buffers, or the bf16 weights that train
        model.to(torch.bfloat16)
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    _log_model(model)

    # Each transformer layer is one FSDP unit; the optimizer's parameters are replaced by the shards. The optimizer is
    # the other entrypoints' (adamw.py): CompensatedAdamW, over fp32 main weights (plain AdamW in its float32 kernel)
    # or over bf16 weights (mixed_precision.fp32_master_weights=false), which then get bf16 gradients. Its weight decay
    # groups are told apart on the model as it is here (whole tensors), and rebuilt by name after sharding.
    weight_decay = cfg.adamw_kwargs.weight_decay
    no_decay = no_weight_decay_names(model)
    optimizer = build_adamw(weight_decay_groups(model, weight_decay), cfg, device)
    main_params_dtype, main_grads_dtype = megatron_fsdp_precision(cfg.mixed_precision, device)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=main_params_dtype, main_grads_dtype=main_grads_dtype)
    with megatron_fsdp_init_step_left_out(optimizer):  # its state-building step changes nothing
        model, optimizer = megatron_fsdp.fully_shard(
            model,
            optimizer,
            device_mesh=meshes.fsdp,
            dp_shard_dim="dp",
            tp_dim="tp",
            fsdp_unit_modules=[type(model.bert.encoder.layers[0])],
            zero_dp_strategy=cfg.fsdp.mfsdp_zero_dp_strategy,
            mixed_precision_policy=policy,
            device=device,
        )
    restore_weight_decay_groups(optimizer, model.module, no_decay, weight_decay)  # fully_shard left one group
    # Fine-tuning (init_from_pretrained): after sharding, into the main weights (fp32, or the bf16 weights); loaded
    # before, fp32 main weights would reach them only through the bf16 compute weights above, rounded.
    apply_pretrained_weights(model, pretrained)
    if float32_init is not None:
        load_full_weights(model, float32_init, "the float32 initialisation")
    train_model = torch.compile(model) if cfg.use_torch_compile else model
    return BuiltModel(model, train_model, config, tokenizer, plan, model_flops, "mfsdp", optimizer=optimizer)


def _log_model(model: NVGeneformerForMaskedLM) -> None:
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    note = recompute_note(model.config)
    logger.info("Model: Geneformer, %s backend, %.1fM parameters%s", model.backend, millions, note)
