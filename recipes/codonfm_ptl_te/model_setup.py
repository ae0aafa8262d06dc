"""The model of a run: its config (``model_tag`` + overrides), its FP8 plan, its construction (on the meta device where
FSDP2 shards it), and, for fine-tuning, the pre-trained weights it starts from.

``lightning_module.py`` calls these from ``configure_model``, Lightning's hook for building a model that a strategy
will shard:

- DDP: the whole model is built on this process's device;
- FSDP2 (``strategy: fsdp2``, Lightning's ``ModelParallelStrategy``): built on the meta device, each ``EncodonLayer``
  and then the root sharded with ``fully_shard`` (:func:`shard_with_fsdp2`), then materialised shard by shard with the
  model's own init (``init_empty_weights``), so no rank ever holds the whole model;
- FSDP (``strategy: fsdp``, Lightning's ``FSDPStrategy``): built whole on this process's device; Lightning wraps each
  ``EncodonLayer`` (the auto-wrap policy, :func:`fsdp_unit`) and shards it right after ``configure_model``.

AdamW's parameter groups (weight_decay.py: decay on the weight matrices and embedding tables, none on biases and
LayerNorm weights) follow the tensors' dimensions under DDP and FSDP2 (a DTensor reports its whole tensor's). FSDP1
shows ``configure_optimizers`` each parameter as a flat 1-D view of this rank's shard, under a name with its wrappers'
segments: there the groups follow the names weight_decay.py gave on the model as built
(:func:`fsdp1_weight_decay_groups`).

FP8 runs through the model's own ``te.autocast``, one per run of same-precision layers (``layer_precision`` + the TE
recipe built here by ``quantization.py``), not through a Lightning precision plugin: see trainer_setup.py.
"""

import logging
import math

import torch
from activation_recompute import recompute_note
from mixed_precision import mixed_precision_policy
from modeling_codonfm_te import (
    EncodonLayer,
    NVEncodonConfig,
    NVEncodonForMaskedLM,
    NVEncodonForSequenceClassification,
    resolve_backend,
)
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops
from quantization import (
    QuantizationPlan,
    build_quantization,
    check_quantized_gemm_shapes,
)
from recipe_paths import model_directory, recipe_path
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from user_errors import ConfigError, MissingPackageError, PathNotFoundError, UnsupportedHardwareError
from weight_decay import log_weight_decay_groups


logger = logging.getLogger(__name__)

NO_FP4 = {"enabled": False}  # NVFP4 needs Blackwell; this recipe offers FP8 only
PROBLEM_TYPES = {"regression": "regression", "classification": "single_label_classification"}  # data.task -> HF


def is_pretraining(cfg: DictConfig) -> bool:
    """data.task mlm: masked-codon pre-training; regression or classification: fine-tuning a sequence head."""
    return cfg.data.task == "mlm"


def head_settings(cfg: DictConfig) -> dict:
    """The sequence-classification config of a fine-tuning run (data.task regression or classification)."""
    task = cfg.data.task
    if task not in PROBLEM_TYPES:
        raise ConfigError(f"data.task={task}: choose mlm, regression or classification")
    if task == "classification" and cfg.data.num_classes is None:
        raise ConfigError("data.task=classification needs data.num_classes, the number of classes the head predicts")
    num_labels = 1 if task == "regression" else int(cfg.data.num_classes)
    return {
        "num_labels": num_labels,
        "problem_type": PROBLEM_TYPES[task],
        "classifier_dropout": cfg.finetune.classifier_dropout,
    }


# ------------------------------------------------------------------------------------------------------- config


def load_model_config(cfg: DictConfig) -> tuple[NVEncodonConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides (and, for fine-tuning, the head's settings), and the
    per-layer FP8 plan."""
    source = model_directory(cfg.model_tag)
    overrides = OmegaConf.to_container(cfg.model_config_overrides, resolve=True)
    known = set(NVEncodonConfig.from_pretrained(source).to_dict())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(
            f"model_config_overrides has keys {unknown} that {source}/config.json does not have; check their spelling"
        )
    if not is_pretraining(cfg):
        overrides.update(head_settings(cfg))
    try:
        config = NVEncodonConfig.from_pretrained(source, **overrides)
        if (
            "vocab_size" in overrides and "padded_vocab_size" not in overrides
        ):  # pad the new vocabulary, not the file's
            config.padded_vocab_size = 64 * math.ceil(config.vocab_size / 64)
        config.validate_nv_encodon()  # from_pretrained sets the overrides after the config's own checks
    except ValueError as error:  # the config names every setting it cannot honour
        raise ConfigError(f"{error}: change model_config_overrides") from None

    fp8_config = OmegaConf.to_container(cfg.fp8_config, resolve=True)
    if fp8_config["enabled"]:
        check_quantized_gemm_shapes({"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size})
    try:
        plan = build_quantization(fp8_config, NO_FP4, config.num_hidden_layers)
    except MissingPackageError:
        raise MissingPackageError(
            "fp8_config.enabled=true needs TransformerEngine and a GPU with compute capability >= 8.9: install "
            "TransformerEngine (see the Dockerfile) or set fp8_config.enabled=false"
        ) from None
    config.layer_precision = plan.layer_precision
    return config, plan


def check_backend(config: NVEncodonConfig) -> str:
    """The backend this machine runs (``te`` on a GPU with TE, else ``torch``); a user error for ``te`` without TE."""
    try:
        return resolve_backend(config.backend)
    except RuntimeError as error:
        raise UnsupportedHardwareError(f"{error} (+model_config_overrides.backend=torch)") from None


# ------------------------------------------------------------------------------------------------------- model


def model_class(pretraining: bool) -> type:
    return NVEncodonForMaskedLM if pretraining else NVEncodonForSequenceClassification


def fsdp_unit() -> type:
    """The module class each FSDP/FSDP2 unit wraps (the model's ``_no_split_modules``)."""
    return EncodonLayer


def build_model(config: NVEncodonConfig, plan: QuantizationPlan, pretraining: bool, device: torch.device | str):
    """The model on ``device`` (``"meta"``: no memory, materialise it later with ``init_empty_weights``)."""
    with torch.device(device):
        model = model_class(pretraining)(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    name, note = type(model).__name__, recompute_note(config)
    logger.info("Model: %s, %s backend, %.1fM parameters%s", name, model.backend, millions, note)
    if plan.enabled:
        logger.info("FP8 layers (1-indexed): %s", [i + 1 for i, p in enumerate(plan.layer_precision) if p == "fp8"])
    return model


def model_flops(model: torch.nn.Module, config: NVEncodonConfig) -> ModelFlops:
    """Count the FLOPs before any wrapping: FSDP's flat parameters would hide their full size."""
    return ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)


def fsdp2_policy(precision: str, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's policy for Lightning's ``precision`` flag: with ``bf16-mixed`` the fp32 master shards are gathered and
    computed in bf16 and gradients reduced in fp32; forward inputs (the float32 rotary table) are never cast."""
    enabled = precision == "bf16-mixed"  # Lightning autocasts on any device it is asked to, CPU included
    return mixed_precision_policy(
        OmegaConf.create({"enabled": enabled, "on_cpu": enabled, "fp32_master_weights": True}), device
    )


def shard_with_fsdp2(model: torch.nn.Module, mesh, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool):
    """``fully_shard`` each EncodonLayer, then the root (embedding, head): each layer is gathered only while it
    computes, and its fp32 master shards are cast to bf16 by ``mp_policy`` for compute."""
    for module in model.modules():
        if isinstance(module, fsdp_unit()):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)


# ------------------------------------------------------------------------------------------- weight decay under FSDP1

# The segments that FSDP1 (torch's FSDP_WRAPPED_MODULE) and torch's activation-checkpoint wrapper
# (_CHECKPOINT_WRAPPED_MODULE) insert into the names of the parameters of the modules they wrap.
FSDP1_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def name_before_wrapping(name: str) -> str:
    """A parameter's name as the model had it before FSDP1 wrapped its modules:
    ``encodon.layers.0._fsdp_wrapped_module.mlp.fc1.weight`` -> ``encodon.layers.0.mlp.fc1.weight``."""
    return ".".join(part for part in name.split(".") if part not in FSDP1_WRAPPER_SEGMENTS)


def fsdp1_weight_decay_groups(
    model: torch.nn.Module, weight_decay: float, built: dict[str, int], no_decay: set[str]
) -> list[dict]:
    """AdamW's parameter groups for ``model`` after FSDP1 (``use_orig_params=True``, Lightning's default) wrapped it:
    ``weight_decay`` on every parameter but those named in ``no_decay``, 0 on those. There each parameter is a flat
    1-D view of this rank's shard (maybe empty), so its ``ndim`` cannot tell a weight matrix from a bias: the names
    decide, those that ``weight_decay.no_weight_decay_names`` gave on the model as built. ``built`` maps every
    parameter's name then to its number of elements (for the log line, which reads as ``weight_decay_groups``'s).
    Every parameter must be one of ``built``, once, and every one of ``built`` must be there."""
    decay, undecayed, seen = [], [], []
    for name, param in model.named_parameters():
        seen.append(name_before_wrapping(name))
        (undecayed if seen[-1] in no_decay else decay).append(param)
    unknown, missing = sorted(set(seen) - set(built)), sorted((set(built) | no_decay) - set(seen))
    if unknown or missing or len(seen) != len(set(seen)):
        raise RuntimeError(
            "FSDP1's parameters are not those of the model as built: cannot split AdamW's weight decay groups by name "
            f"(not built: {unknown[:3]}; not found: {missing[:3]}; named twice: {len(seen) - len(set(seen))})"
        )
    log_weight_decay_groups(
        model,
        weight_decay,
        [size for name, size in built.items() if name not in no_decay],
        [size for name, size in built.items() if name in no_decay],
    )
    return [{"params": decay, "weight_decay": weight_decay}, {"params": undecayed, "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------- pre-trained weights


def read_pretrained_weights(path: str) -> dict[str, torch.Tensor]:
    """The weights (on CPU) of an export directory (``model.safetensors``) or of a Lightning checkpoint (``.ckpt``)
    of this recipe; keys as in the Hugging Face model (``encodon.*``, ``lm_head.*``, ``classifier.*``)."""
    source = recipe_path(path)
    if source.is_dir():
        weights = source / "model.safetensors"
        if not weights.is_file():
            raise PathNotFoundError(
                f"finetune.init_from={path} holds no model.safetensors: point it at an export (final_model/) or a "
                "Lightning checkpoint (.ckpt)"
            )
        return load_file(weights)
    if not source.is_file():
        raise PathNotFoundError(f"finetune.init_from={path}: no such export directory or checkpoint file")
    # The checkpoint holds Lightning's loop and callback state besides tensors; it is one this recipe wrote.
    checkpoint = torch.load(source, map_location="cpu", mmap=True, weights_only=False)
    if "state_dict" not in checkpoint:
        raise ConfigError(f"finetune.init_from={path} is not a Lightning checkpoint (it has no state_dict)")
    prefix = "model."  # the LightningModule holds the Hugging Face model as `self.model`
    return {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def load_encoder_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy the pre-trained encoder (``encodon.*``) into ``model``, whole or FSDP2-sharded. The head of a
    fine-tuning model starts from its own init; every encoder weight must be there, with its shape."""
    encoder = {k: v for k, v in weights.items() if k.startswith("encodon.") and not k.endswith("_extra_state")}
    expected = {k for k in model.state_dict() if k.startswith("encodon.") and not k.endswith("_extra_state")}
    missing, unexpected = sorted(expected - set(encoder)), sorted(set(encoder) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{source} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}; use the model_tag "
            "(and model_config_overrides) of the pre-training run"
        )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # a DTensor reports its global shape
    wrong = [k for k in encoder if tuple(encoder[k].shape) != shapes[k]]
    if wrong:
        raise ConfigError(
            f"{source} does not fit this model: {wrong[0]} is {list(encoder[wrong[0]].shape)} there and "
            f"{list(shapes[wrong[0]])} here; use the model_tag (and model_config_overrides) of the pre-training run"
        )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, encoder, options=options)  # every rank keeps its own shards
    else:
        model.load_state_dict(encoder, strict=False)
    logger.info("Fine-tuning from the encoder weights in %s", source)
