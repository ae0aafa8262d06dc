"""Building the model, the one way every entrypoint does it: config, precision plan, construction, pretrained weights,
sharding, init.

``model_tag`` is a directory (or Hugging Face Hub id) holding a ``config.json``: one of this recipe's
``model_configs/`` to pre-train from scratch (ESM-2 or AMPLIFY), an export of this recipe, a stock Hugging Face
ESM-2 checkpoint or a published AMPLIFY one (``model_families.py`` tells them apart). With
``init_from_pretrained: true`` its weights are loaded too (stock checkpoints are converted on the fly): fine-tuning.

``build_model(cfg, device, meshes, strategy)`` returns a :class:`BuiltModel`. Strategies:

- ``"ddp"``: the whole model on every rank, wrapped in ``DistributedDataParallel`` when a process group exists;
- ``"fsdp2"``: each transformer layer, then the root (embeddings, LM head), sharded over ``meshes.fsdp`` with
  ``fully_shard`` and the one mixed-precision policy (``mixed_precision.mixed_precision_policy``); built on the
  meta device when ``fsdp.use_meta_device``, so each rank materialises only its own shards. With ``meshes.cp`` the
  model's attention is split over that context-parallel group;
- ``"mfsdp"``: Megatron-FSDP (CUDA only) over the ``("dp", "tp")`` mesh in ``meshes.fsdp``. It shards the model and
  its optimizer together, so for this strategy the optimizer is built here too.

``build_optimizer(cfg, model, device)`` is the AdamW of the other strategies (see its docstring for bf16 weights).
"""

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from activation_recompute import recompute_note
from adamw import build_adamw, megatron_fsdp_init_step_left_out
from compensated_adamw import split_float32_masters
from distributed import Meshes, data_parallel_wrapper
from mixed_precision import (
    computes_in_bf16,
    holds_masters_in_optimizer,
    keeps_fp32_master_weights,
    megatron_fsdp_precision,
    mixed_precision_policy,
    settle_masters_in_optimizer,
)
from model_families import (
    PRETRAINED_MISMATCH,
    ModelFamily,
    family_of,
    load_model_config,
    load_pretrained_state_dict,
    model_source,
)
from modeling_esm_te import resolve_backend  # the same function in both modeling files: is TE usable here?
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops
from pretrained_weights import load_full_weights, weights_on_the_host
from quant_stats import QuantStats
from quantization import QuantizationPlan, check_quantization_supported
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import PretrainedConfig
from user_errors import ConfigError, UnsupportedHardwareError


logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2", "mfsdp")


@dataclass
class BuiltModel:
    """What the entrypoints use of the model."""

    # Parameters for the optimizer, checkpoints and export: the bare model (DDP), sharded in place (FSDP2), or
    # Megatron-FSDP's wrapper (its ``.module`` is the model).
    model: torch.nn.Module
    train_model: torch.nn.Module  # what the loop calls: the DDP wrapper and/or torch.compile of ``model``
    config: PretrainedConfig  # NVEsmConfig or NVAmplifyConfig
    plan: QuantizationPlan
    model_flops: ModelFlops
    strategy: str
    ddp: DistributedDataParallel | None = None
    optimizer: torch.optim.Optimizer | None = None  # "mfsdp" only: sharded together with the model
    # mixed_precision.masters_in_optimizer: each bf16 weight's fp32 low bits, for CompensatedAdamW (else None)
    master_low_bits: dict | None = None

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients in this backward (``enabled``) or only accumulate them locally (earlier micro-batches).

        Enter it around the forward and the backward of a micro-batch.
        """
        if self.strategy == "fsdp2":
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if enabled:
            return contextlib.nullcontext()
        if self.strategy == "mfsdp":
            return self.model.no_sync()
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()


def apply_pretrained_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Copy ``state`` into ``model``, whole or sharded (FSDP2, Megatron-FSDP: every rank its own part); every weight
    must be there with its shape."""
    if state is None:
        return
    try:
        load_full_weights(model, state, "the pretrained checkpoint")
    except ValueError as error:
        raise ConfigError(f"{error}; {PRETRAINED_MISMATCH}") from None


def build_model(
    cfg: DictConfig,
    device: torch.device,
    meshes: Meshes | None,
    strategy: str,
    quant_stats: QuantStats | None = None,
) -> BuiltModel:
    """The model of this run, built, placed (and sharded) for ``strategy``: initialised from ``cfg.seed``'s RNG, or
    with ``init_from_pretrained`` from the weights in ``model_tag``.

    ``meshes`` may be None for ``"ddp"`` (it uses the default process group, if any). ``quant_stats`` (started
    before this call: TE reads its debug config when it builds its first layer) learns the layers' names.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    family = family_of(model_source(cfg))
    config, plan = load_model_config(
        cfg, OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
    )
    check_quantization_supported(plan, device)  # FP8/FP4 on a machine that cannot run it fails here
    try:
        # backend=te on a machine without TE or a GPU fails here, in one line
        resolve_backend(config.backend)
    except RuntimeError as error:
        raise UnsupportedHardwareError(f"{error} (+model_config_overrides.backend=torch)") from None
    settle_masters_in_optimizer(cfg, strategy, device)  # FSDP2 and Megatron-FSDP keep their own fp32 masters
    masters_in_optimizer = holds_masters_in_optimizer(cfg.mixed_precision, device)
    if strategy == "mfsdp":
        return _build_megatron_fsdp(cfg, device, meshes, family, config, plan, quant_stats)
    on_meta = strategy == "fsdp2" and cfg.fsdp.use_meta_device
    with torch.device("meta" if on_meta else device):
        model = family.model_class(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    pretrained = load_pretrained_state_dict(cfg)
    if strategy == "ddp":
        apply_pretrained_weights(model, pretrained)
    master_low_bits = None
    if masters_in_optimizer:
        master_low_bits = split_float32_masters(model)  # bf16 weights; the fp32 low bits go to CompensatedAdamW
    elif computes_in_bf16(cfg.mixed_precision, device) and not keeps_fp32_master_weights(cfg.mixed_precision, device):
        model.to(torch.bfloat16)  # bf16 weights and optimizer state: less memory, no fp32 master copy
    if quant_stats is not None:
        quant_stats.watch(model)
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    log_model(model, config)

    if meshes is not None and meshes.cp is not None:
        # Every attention layer exchanges K/V blocks with the other ranks of this rank's CP group.
        cp_group = meshes.cp.get_group()
        cp_stream = torch.cuda.Stream() if device.type == "cuda" else None
        family.encoder(model).set_context_parallel_group(cp_group, dist.get_process_group_ranks(cp_group), cp_stream)

    ddp = None
    if strategy == "fsdp2":
        # FSDP2 over meshes.fsdp (dp x cp with context parallelism: CP ranks hold the same weights).
        policy = mixed_precision_policy(cfg.mixed_precision, device)
        reshard = cfg.fsdp.reshard_after_forward
        for layer in family.transformer_layers(model):
            fully_shard(layer, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard)
        if on_meta:
            model.init_empty_weights(device)
        apply_pretrained_weights(model, pretrained)  # fine-tuning: every rank loads its own shards
        train_model = model
    else:
        # The same random init on every rank (same seed), and DDP broadcasts rank 0's weights anyway. The buffers
        # (rotary frequencies, contact-head weights) never change: no per-step broadcast.
        ddp = data_parallel_wrapper(model, device, float32_average=masters_in_optimizer)  # None: one process
        train_model = ddp or model
    if cfg.use_torch_compile:
        train_model = torch.compile(train_model)
    return BuiltModel(model, train_model, config, plan, model_flops, strategy, ddp, master_low_bits=master_low_bits)


def build_optimizer(
    cfg: DictConfig, model: torch.nn.Module, device: torch.device, master_low_bits: dict | None = None
) -> torch.optim.Optimizer:
    """AdamW with ``cfg.adamw_kwargs`` over the model built by ``build_model`` (DDP, FSDP2 and CP entrypoints):
    torch's for fp32 weights, ``CompensatedAdamW`` for bf16 weights (adamw.py); ``master_low_bits``: the built
    model's, with ``mixed_precision.masters_in_optimizer``."""
    return build_adamw(model.parameters(), cfg, device, master_low_bits)


def log_model(model: torch.nn.Module, config) -> None:
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    fused = model.backend == "te" and getattr(config, "fused_residual_norm", False)
    layers = " (FusedResidualTransformerLayer: residual adds inside the norm kernels)" if fused else ""
    logger.info("Model: %s backend%s, %.1fM parameters%s", model.backend, layers, millions, recompute_note(config))


def _build_megatron_fsdp(cfg, device, meshes, family: ModelFamily, config, plan, quant_stats) -> BuiltModel:
    """Megatron-FSDP: the model built whole on this GPU, then sharded together with its optimizer.

    Megatron-FSDP's meta-device path would initialise weights with each module's reset_parameters(), not the model's own
    initialisation, so it is not used. Its fp32 main weights live in its own sharded buffers, so the model itself is
    cast to bf16 whenever bf16 compute is on; with ``fp32_master_weights: false`` those bf16 weights are what trains.
    ``fully_shard`` builds those main weights from the bf16 model, so the float32 initialisation (or the pretrained
    weights) is loaded into them after sharding.
    """
    import megatron_fsdp

    with torch.device(device):
        model = family.model_class(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    pretrained = load_pretrained_state_dict(cfg)
    # fully_shard builds fp32 main weights from the model it is given, cast to bf16 below: the float32 initialisation
    # is kept on the host and loaded into them after sharding (pretrained weights are loaded there anyway). Built from
    # bf16 values, the first small updates would not move the bf16 compute weights (ESM-2 650M: loss 3.56 against
    # 3.25 at step 10; docs/benchmarks.md).
    keep_initialisation = pretrained is None and keeps_fp32_master_weights(cfg.mixed_precision, device)
    float32_init = weights_on_the_host(model) if keep_initialisation else None
    if cfg.mixed_precision.enabled:
        # bf16 compute weights beside fp32 main weights in Megatron-FSDP's buffers, or the bf16 weights that train
        model.to(torch.bfloat16)
    if quant_stats is not None:
        quant_stats.watch(model)
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    log_model(model, config)

    # Each transformer layer is one FSDP unit; the optimizer's parameter groups are rebuilt over the shards. The
    # optimizer is the other entrypoints' (adamw.py): CompensatedAdamW, over fp32 main weights (plain AdamW in its
    # float32 kernel) or over bf16 weights (mixed_precision.fp32_master_weights=false), which then get bf16 gradients.
    optimizer = build_adamw(model.parameters(), cfg, device)
    main_params_dtype, main_grads_dtype = megatron_fsdp_precision(cfg.mixed_precision, device)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=main_params_dtype, main_grads_dtype=main_grads_dtype)
    with megatron_fsdp_init_step_left_out(optimizer):  # its state-building step changes nothing
        model, optimizer = megatron_fsdp.fully_shard(
            model,
            optimizer,
            device_mesh=meshes.fsdp,
            dp_shard_dim="dp",
            tp_dim="tp",
            fsdp_unit_modules=[type(family.transformer_layers(model)[0])],
            zero_dp_strategy=cfg.fsdp.mfsdp_zero_dp_strategy,
            mixed_precision_policy=policy,
            device=device,
        )
    # Fine-tuning (init_from_pretrained): after sharding, into the main weights (fp32, or the bf16 weights); loaded
    # before, fp32 main weights would reach them only through the bf16 compute weights above, rounded.
    apply_pretrained_weights(model, pretrained)
    if float32_init is not None:
        load_full_weights(model, float32_init, "the float32 initialisation")
    train_model = torch.compile(model) if cfg.use_torch_compile else model
    return BuiltModel(model, train_model, config, plan, model_flops, "mfsdp", optimizer=optimizer)
