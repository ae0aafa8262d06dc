"""Building the ViT, the one way every entrypoint does it: config (with the data's classes), precision plan,
construction, pretrained weights, sharding, init.

``model_tag`` is a directory (or Hugging Face Hub id) holding a ``config.json``: one of this recipe's
``model_configs/`` (ViT-Tiny/Small/Base at 224 pixels, the 32-pixel ``vit-l0-tiny``) to train from scratch, an export
of this recipe, or a stock Hugging Face ``ViTForImageClassification`` checkpoint (converted on load). With
``init_from_pretrained: true`` its weights are loaded too: fine-tuning. The classifier always has one output per class
of the data; a pretrained classifier of another size is replaced by a new one (initialised from ``seed``), and the
log says so.

``build_model(cfg, device, meshes, strategy, class_names)`` returns a :class:`BuiltModel`. Strategies:

- ``"ddp"``: the whole model on every rank, wrapped in ``DistributedDataParallel`` when a process group exists;
- ``"fsdp2"``: each transformer layer, then the root (embeddings, final norm, classifier), sharded over
  ``meshes.fsdp`` with ``fully_shard`` and the one mixed-precision policy; built on the meta device when
  ``fsdp.use_meta_device``, so each rank materialises only its own shards;
- ``"mfsdp"``: Megatron-FSDP (CUDA only) over the mesh of ``mfsdp_mesh`` (``dp_replicate`` x ``dp_shard`` x ``tp``).
  It shards the model and its optimizer together, so for this strategy the optimizer is built here too. With
  ``mfsdp.tp > 1`` each TE layer is split over the ``tp`` ranks (tensor parallelism) and Megatron-FSDP shards those
  shares further over ``dp_shard``.

Every strategy's AdamW gets the parameter groups of ``weight_decay.weight_decay_groups`` (no decay on biases, LayerNorm
weights, the class token and the position embeddings).
"""

import contextlib
import logging
from dataclasses import dataclass

import torch
from adamw import build_adamw, megatron_fsdp_init_step_left_out
from convert import convert_vit_hf_to_te, nv_config_from_hf
from distributed import Meshes, data_parallel_wrapper
from image_transforms import EVAL_CROP_FRACTION
from mixed_precision import (
    computes_in_bf16,
    keeps_fp32_master_weights,
    megatron_fsdp_precision,
    mixed_precision_policy,
)
from modeling_vit_te import NVViTConfig, NVViTForImageClassification, resolve_backend, tensor_parallel_shard
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops
from pretrained_weights import load_full_weights, weights_on_the_host
from quantization import (
    QuantizationPlan,
    build_quantization,
    check_quantization_supported,
    check_quantized_gemm_shapes,
)
from recipe_paths import looks_like_hub_id, model_directory, recipe_path
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import BitImageProcessorPil, PretrainedConfig, ViTConfig, ViTForImageClassification
from transformers.image_utils import PILImageResampling
from user_errors import ConfigError, UnsupportedHardwareError
from weight_conversion import load_state_dict_exactly
from weight_decay import no_weight_decay_names, restore_weight_decay_groups, weight_decay_groups


logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2", "mfsdp")
CLASSIFIER_KEYS = ("classifier.weight", "classifier.bias")
PRETRAINED_MISMATCH = (
    "the model_tag weights do not fit this model: drop the model_config_overrides that change its shape"
)


# ----------------------------------------------------------------------------------------- config and weights


def model_source(cfg: DictConfig) -> str:
    """``model_tag`` as a local directory when one exists (recipe-relative paths included), else as a Hub id."""
    if recipe_path(cfg.model_tag).exists() or not looks_like_hub_id(str(cfg.model_tag)):
        return str(model_directory(cfg.model_tag, weights=cfg.init_from_pretrained))
    return str(cfg.model_tag)


def is_stock_vit(source: str) -> bool:
    """True for a stock ``ViTForImageClassification``, False for this project's config or export."""
    config = PretrainedConfig.get_config_dict(source)[0]
    if any(name.startswith("NVViT") for name in config.get("architectures") or []):
        return False
    if config.get("model_type") == "vit":
        return True
    raise ConfigError(
        f"model_tag {source} holds a {config.get('model_type')!r} model, not a ViT: point it at one of this recipe's "
        "model_configs/, an export of this recipe, or a Hugging Face ViTForImageClassification checkpoint"
    )


def read_model_config(source: str, **overrides) -> NVViTConfig:
    """The NV config of ``source`` with ``overrides`` applied and checked."""
    if is_stock_vit(source):
        config = nv_config_from_hf(ViTConfig.from_pretrained(source), **overrides)
    else:
        config = NVViTConfig.from_pretrained(source, **overrides)
    config.validate_nv_vit()
    return config


def load_model_config(cfg: DictConfig, class_names: list[str]) -> tuple[NVViTConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, one output per class of the data, and the per-layer
    FP8/FP4 plan the model needs."""
    source = model_source(cfg)
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(read_model_config(source).to_dict()))
    if unknown:
        raise ConfigError(
            f"model_config_overrides has keys {unknown} that {source}/config.json does not have; check their spelling"
        )
    labels = {
        "num_labels": len(class_names),
        "id2label": dict(enumerate(class_names)),
        "label2id": {name: index for index, name in enumerate(class_names)},
    }
    try:
        config = read_model_config(source, **overrides, **labels)
    except ValueError as error:  # NVViTConfig names every setting it cannot honour
        raise ConfigError(f"{error}: change model_config_overrides") from None
    fp8_config, fp4_config = OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
    if fp8_config["enabled"] or fp4_config["enabled"]:
        check_quantized_gemm_shapes({"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size})
    plan = build_quantization(fp8_config, fp4_config, config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    return config, plan


def model_image_size(cfg: DictConfig) -> int:
    """The side, in pixels, of the images the model of ``cfg`` takes (its config.json and overrides): the data
    pipeline resizes to it, before the model (whose classifier needs the data's classes) is built."""
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    image_size = overrides.get("image_size", read_model_config(model_source(cfg)).image_size)
    if isinstance(image_size, list | tuple):
        if image_size[0] != image_size[1]:
            raise ConfigError(f"image_size {image_size}: this recipe trains on square images; give one number")
        image_size = image_size[0]
    return int(image_size)


def tokens_per_image(config: NVViTConfig) -> int:
    """Patches plus the class token: the sequence length every image of this model has."""
    height, width = config.image_size if isinstance(config.image_size, list | tuple) else (config.image_size,) * 2
    return (height // config.patch_size) * (width // config.patch_size) + 1


def image_processor(cfg: DictConfig, config: NVViTConfig) -> BitImageProcessorPil:
    """What the export ships as ``preprocessor_config.json``: the evaluation transform that validation (which picks
    ``best_model``) and ``infer.py`` use (image_transforms.py), for Hugging Face's image processors: RGB, the shorter
    side resized to ``round(S / EVAL_CROP_FRACTION)`` (bilinear), the central S x S, scaled to [0, 1], normalised with
    this run's ``dataset.mean`` / ``dataset.std``. A ``ViTImageProcessor`` would resize straight to S x S instead,
    squashing every image that is not square.

    Saved as a ``BitImageProcessor`` (the class whose steps these are), which ``AutoImageProcessor.from_pretrained``
    loads; this is its Pillow implementation, which needs no torchvision. Two small differences remain: it resizes
    8-bit pixels where the recipe resizes float32 ones (about one grey level apart), and its central crop rounds half
    an odd margin down where torchvision's and the recipe's round half to even, so for a margin of 4k + 3 pixels (the
    resized image that much longer than S along one side) the two crops lie one pixel apart along that side.
    """
    side = config.image_size[0] if isinstance(config.image_size, list | tuple) else config.image_size
    return BitImageProcessorPil(
        do_convert_rgb=True,
        do_resize=True,
        size={"shortest_edge": round(side / EVAL_CROP_FRACTION)},
        resample=PILImageResampling.BILINEAR,
        do_center_crop=True,
        crop_size={"height": side, "width": side},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(cfg.dataset.mean),
        image_std=list(cfg.dataset.std),
    )


def load_pretrained_state_dict(cfg: DictConfig, config: NVViTConfig) -> dict[str, torch.Tensor] | None:
    """Full (CPU, float32) weights from ``model_tag`` when ``init_from_pretrained`` is set, else None. A classifier for
    another number of classes is left out: the model keeps its freshly initialised one."""
    if not cfg.init_from_pretrained:
        return None
    source = model_source(cfg)
    if is_stock_vit(source):
        stock = ViTForImageClassification.from_pretrained(source, dtype=torch.float32)
        model = convert_vit_hf_to_te(stock, backend="torch")
    else:
        model = NVViTForImageClassification.from_pretrained(source, backend="torch", dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if state["classifier.weight"].shape[0] != config.num_labels:
        logger.info(
            "Fine-tuning from %s with a new classifier: %d classes in the data, %d in the checkpoint",
            source,
            config.num_labels,
            state["classifier.weight"].shape[0],
        )
        for key in CLASSIFIER_KEYS:
            del state[key]
    else:
        logger.info("Fine-tuning from the weights in %s", source)
    return state


def apply_pretrained_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Copy ``state`` into ``model``, whole or sharded (FSDP2, Megatron-FSDP: every rank its own part); every weight
    but a replaced classifier (which keeps its init) must be there with its shape."""
    if state is None:
        return
    try:
        load_full_weights(model, state, "the pretrained checkpoint", keep=CLASSIFIER_KEYS)
    except ValueError as error:
        raise ConfigError(f"{error}; {PRETRAINED_MISMATCH}") from None


def model_flops(model: NVViTForImageClassification, config: NVViTConfig) -> ModelFlops:
    """FLOPs per token of the matrix multiplies: every parameter but the class token, position embeddings and the
    classifier (which runs once per image, not per token: a negligible share)."""
    skipped = {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings", *CLASSIFIER_KEYS}
    per_token = sum(p.numel() for name, p in model.named_parameters() if name not in skipped)
    return ModelFlops(per_token, config.num_hidden_layers, config.hidden_size)


# ------------------------------------------------------------------------------------------------ the model


@dataclass
class BuiltModel:
    """What the entrypoints use of the model."""

    # Parameters for the optimizer, checkpoints and export: the bare model (DDP), sharded in place (FSDP2), or
    # Megatron-FSDP's wrapper (its ``.module`` is the model).
    model: torch.nn.Module
    train_model: torch.nn.Module  # what the loop calls: the DDP wrapper and/or torch.compile of ``model``
    config: NVViTConfig
    plan: QuantizationPlan
    model_flops: ModelFlops
    strategy: str
    ddp: DistributedDataParallel | None = None
    optimizer: torch.optim.Optimizer | None = None  # "mfsdp" only: sharded together with the model
    # "mfsdp" with mfsdp.tp > 1: this rank's place among the ranks that split each layer (and see the same images).
    tensor_parallel_rank: int = 0

    @property
    def tokens_per_image(self) -> int:
        return tokens_per_image(self.config)

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


def build_model(
    cfg: DictConfig, device: torch.device, meshes: Meshes | None, strategy: str, class_names: list[str]
) -> BuiltModel:
    """The model of this run, built, placed (and sharded) for ``strategy``: initialised from ``cfg.seed``'s RNG, or
    with ``init_from_pretrained`` from the weights in ``model_tag``. ``meshes`` may be None for ``"ddp"``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    config, plan = load_model_config(cfg, class_names)
    check_quantization_supported(plan, device)  # FP8/FP4 on a machine that cannot run it fails here
    try:
        resolve_backend(config.backend)  # backend=te on a machine without TE or a GPU fails here, in one line
    except RuntimeError as error:
        raise UnsupportedHardwareError(f"{error} (+model_config_overrides.backend=torch)") from None
    pretrained = load_pretrained_state_dict(cfg, config)
    if strategy == "mfsdp":
        return _build_megatron_fsdp(cfg, device, meshes, config, plan, pretrained)

    on_meta = strategy == "fsdp2" and cfg.fsdp.use_meta_device
    with torch.device("meta" if on_meta else device):
        model = NVViTForImageClassification(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    if strategy == "ddp":
        apply_pretrained_weights(model, pretrained)
    if computes_in_bf16(cfg.mixed_precision, device) and not keeps_fp32_master_weights(cfg.mixed_precision, device):
        model.to(torch.bfloat16)  # bf16 weights and optimizer state: less memory, no fp32 master copy
    flops = model_flops(model, config)
    _log_model(model)

    ddp = None
    if strategy == "fsdp2":
        policy = mixed_precision_policy(cfg.mixed_precision, device)
        reshard = cfg.fsdp.reshard_after_forward
        for layer in model.vit.encoder.layers:
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
    return BuiltModel(model, train_model, config, plan, flops, strategy, ddp)


# ------------------------------------------------------------------------------------------------ Megatron-FSDP


def mfsdp_mesh(cfg: DictConfig, world_size: int) -> DeviceMesh:
    """The ``("dp_replicate", "dp_shard", "tp")`` mesh of ``cfg.mfsdp``: ``dp_replicate`` full replicas (HSDP), each
    sharded over ``dp_shard`` GPUs; each layer split over ``tp`` GPUs (tensor parallelism; neighbouring ranks, so on
    one node)."""
    replicate, tp = int(cfg.mfsdp.dp_replicate), int(cfg.mfsdp.tp)
    if tp < 1:
        raise ConfigError(f"mfsdp.tp={tp}: the tensor-parallel size must be 1 (off) or more")
    if replicate < 1 or world_size % (replicate * tp):
        raise ConfigError(
            f"mfsdp.dp_replicate={replicate} x mfsdp.tp={tp} must divide the number of processes ({world_size}); "
            "launch a multiple of their product (torchrun --nproc_per_node=...)"
        )
    shape = (replicate, world_size // (replicate * tp), tp)
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    # Megatron-FSDP reduces over replicas and shards together through this flattened group; the data-parallel rank
    # (which share of the data a GPU reads) is a GPU's place in it.
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    return mesh


def _build_megatron_fsdp(cfg, device, meshes, config, plan, pretrained) -> BuiltModel:
    """Megatron-FSDP: the model built whole on this GPU, then sharded together with its optimizer.

    Megatron-FSDP's meta-device path would initialise weights with each module's reset_parameters(), not the model's
    own initialisation, so it is not used. Its fp32 main weights live in its own sharded buffers, so the model itself is
    cast to bf16 whenever bf16 compute is on; with ``fp32_master_weights: false`` those bf16 weights are what trains.
    ``fully_shard`` builds those main weights from the bf16 model, so the float32 initialisation (or the pretrained
    weights) is loaded into them after sharding.

    With tensor parallelism the whole model is built first, as one GPU builds it (same seed, same numbers), and each
    rank keeps its share of it: a run with ``mfsdp.tp=2`` starts from the weights of a 1-GPU run, not from TE's
    per-shard initialisation (which would depend on the TP size).
    """
    import megatron_fsdp

    mesh = meshes.fsdp
    with torch.device(device):
        model = NVViTForImageClassification(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    flops = model_flops(model, config)  # of the whole model: tensor-parallel ranks share one model's work
    tp_rank = mesh["tp"].get_local_rank()
    tensor_parallel = mesh["tp"].size() > 1
    if tensor_parallel:
        # Each rank's share is cut from the whole model, so the pretrained weights go in first; Megatron-FSDP's fp32
        # main weights then start from the bf16 compute weights below (the weights rounded to bf16).
        apply_pretrained_weights(model, pretrained)
        model = _tensor_parallel_share(model, config, plan, mesh["tp"], device)
    fp32_main_weights = keeps_fp32_master_weights(cfg.mixed_precision, device)
    if tensor_parallel and fp32_main_weights:  # a rank's share is no full tensor: not loaded after sharding
        logger.warning(
            "mfsdp.tp=%d: Megatron-FSDP's fp32 main weights start from the %s rounded to bf16 "
            "(without tensor parallelism they start from the float32 values exactly)",
            mesh["tp"].size(),
            "initialisation" if pretrained is None else "pretrained weights",
        )
    # fully_shard builds fp32 main weights from the model it is given, cast to bf16 below: the float32 initialisation
    # is kept on the host and loaded into them after sharding (pretrained weights are loaded there anyway). Built from
    # bf16 values, the first small updates would not move the bf16 compute weights (ESM-2 650M: loss 3.56 against
    # 3.25 at step 10; docs/benchmarks.md).
    keep_initialisation = pretrained is None and fp32_main_weights and not tensor_parallel
    float32_init = weights_on_the_host(model) if keep_initialisation else None
    if cfg.mixed_precision.enabled:
        # bf16 compute weights beside fp32 main weights in Megatron-FSDP's buffers, or the bf16 weights that train
        model.to(torch.bfloat16)
    _log_model(model)

    # Each transformer layer is one FSDP unit; the optimizer's parameters are replaced by the shards. The optimizer is
    # the other entrypoints' (adamw.py): CompensatedAdamW, over fp32 main weights (plain AdamW in its float32 kernel)
    # or over bf16 weights (mixed_precision.fp32_master_weights=false), which then get bf16 gradients. Its weight
    # decay groups are told apart on the model as it is here (whole tensors), and rebuilt by name after sharding.
    weight_decay = cfg.adamw_kwargs.weight_decay
    no_decay = no_weight_decay_names(model)
    optimizer = build_adamw(weight_decay_groups(model, weight_decay), cfg, device)
    main_params_dtype, main_grads_dtype = megatron_fsdp_precision(cfg.mixed_precision, device)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=main_params_dtype, main_grads_dtype=main_grads_dtype)
    hsdp = mesh["dp_replicate"].size() > 1
    with megatron_fsdp_init_step_left_out(optimizer):  # its state-building step changes nothing
        model, optimizer = megatron_fsdp.fully_shard(
            model,
            optimizer,
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_replicate" if hsdp else None,
            hybrid_fsdp_group=mesh["dp"].get_group() if hsdp else None,
            tp_dim="tp",
            fsdp_unit_modules=[type(model.vit.encoder.layers[0])],
            zero_dp_strategy=cfg.fsdp.mfsdp_zero_dp_strategy,
            mixed_precision_policy=policy,
            device=device,
        )
    restore_weight_decay_groups(optimizer, model.module, no_decay, weight_decay)  # fully_shard left one group
    if not tensor_parallel:
        # Fine-tuning (init_from_pretrained): after sharding, into the main weights (fp32, or the bf16 weights); loaded
        # before, fp32 main weights would reach them only through the bf16 compute weights above, rounded.
        apply_pretrained_weights(model, pretrained)
    if float32_init is not None:
        load_full_weights(model, float32_init, "the float32 initialisation")
    train_model = torch.compile(model) if cfg.use_torch_compile else model
    return BuiltModel(
        model, train_model, config, plan, flops, "mfsdp", optimizer=optimizer, tensor_parallel_rank=tp_rank
    )


def _tensor_parallel_share(
    whole: NVViTForImageClassification, config: NVViTConfig, plan: QuantizationPlan, tp_mesh: DeviceMesh, device
) -> NVViTForImageClassification:
    """The tensor-parallel model of this rank holding its share of ``whole``'s weights."""
    # Building it draws TE's own init from the RNG; forked, so the run's random stream after the build is a 1-GPU
    # run's (the same augmentations on the same steps).
    with torch.random.fork_rng(devices=[device]):
        try:
            with torch.device(device):
                model = NVViTForImageClassification(
                    config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe, tp_group=tp_mesh.get_group()
                )
        except ValueError as error:  # heads or MLP width not divisible, or the torch backend
            raise ConfigError(f"mfsdp.tp={tp_mesh.size()}: {error}") from None
    share = tensor_parallel_shard(model, whole.state_dict(), tp_mesh.get_local_rank(), tp_mesh.size())
    load_state_dict_exactly(model, share, "this rank's tensor-parallel share of the model")
    logger.info("Tensor parallelism: each transformer layer split over %d GPUs", tp_mesh.size())
    return model


def _log_model(model: NVViTForImageClassification) -> None:
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    config = model.config
    logger.info(
        "Model: ViT, %s backend, %.1fM parameters, %d classes, %d tokens per image",
        model.backend,
        millions,
        config.num_labels,
        tokens_per_image(config),
    )
