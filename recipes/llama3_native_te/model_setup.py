"""Building the model, the one way every entrypoint does it: config, precision plan, construction, sharding, init.

``build_model(cfg, device, meshes, strategy)`` returns a :class:`BuiltModel`. Strategies:

- ``"ddp"``: the whole model on every rank, wrapped in ``DistributedDataParallel`` when launched by torchrun;
- ``"fsdp2"``: each transformer layer, then the root (embeddings, final norm, LM head), sharded with
  ``fully_shard`` and the one mixed-precision policy (``mixed_precision.mixed_precision_policy``); built on the
  meta device when ``fsdp.use_meta_device``, so each rank materialises only its own shards. With ``meshes.cp`` the
  model's attention is split over that context-parallel group.
"""

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from activation_recompute import recompute_note
from compensated_adamw import split_float32_masters
from distributed import Meshes, data_parallel_wrapper
from fused_layer_choice import keep_fused_layers_only_where_they_run
from mixed_precision import (
    computes_in_bf16,
    holds_masters_in_optimizer,
    keeps_fp32_master_weights,
    mixed_precision_policy,
    settle_masters_in_optimizer,
)
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM, resolve_backend
from omegaconf import DictConfig, OmegaConf
from perf_logger import ModelFlops
from quantization import (
    QuantizationPlan,
    build_quantization,
    check_quantization_supported,
)
from recipe_paths import model_directory
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from user_errors import ConfigError, UnsupportedHardwareError


logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2")


@dataclass
class BuiltModel:
    """What the entrypoints use of the model."""

    model: NVLlamaForCausalLM  # parameters for the optimizer, checkpoints and export (sharded in place by FSDP2)
    train_model: torch.nn.Module  # what the loop calls: the DDP wrapper and/or torch.compile of ``model``
    config: NVLlamaConfig
    plan: QuantizationPlan
    model_flops: ModelFlops
    strategy: str
    ddp: DistributedDataParallel | None = None
    # FSDP2: free the gathered weights after every backward (True), or keep them from one micro-batch of a step
    # to the next (False: no gather between micro-batches; the step's last backward frees them). fsdp.reshard_after_backward.
    reshard_between_micro_batches: bool = True
    # mixed_precision.masters_in_optimizer: each bf16 weight's fp32 low bits, for CompensatedAdamW (else None)
    master_low_bits: dict | None = None

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients in this backward (``enabled``) or only accumulate them locally (earlier micro-batches)."""
        if self.strategy == "fsdp2":
            self.model.set_requires_gradient_sync(enabled)
            # The last micro-batch (``enabled``) always reshards: the optimizer steps on the shards.
            self.model.set_reshard_after_backward(enabled or self.reshard_between_micro_batches)
            return contextlib.nullcontext()
        return self.ddp.no_sync() if self.ddp is not None and not enabled else contextlib.nullcontext()


def load_model_config(cfg: DictConfig) -> tuple[NVLlamaConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, and the per-layer FP8/FP4 plan the model needs."""
    model_dir = model_directory(cfg.model_tag)  # a directory without config.json fails here, by name
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(NVLlamaConfig.from_pretrained(model_dir).to_dict()))
    if unknown:
        raise ConfigError(
            f"model_config_overrides has keys {unknown} that {model_dir}/config.json does not have: check the spelling"
        )
    config = NVLlamaConfig.from_pretrained(model_dir, **overrides)
    fp8_config, fp4_config = OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
    plan = build_quantization(fp8_config, fp4_config, config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    keep_fused_layers_only_where_they_run(cfg, config)  # FP4/MXFP8, CP or compile: TE's layers, one warning
    config.validate_nv_llama()
    return config, plan


def build_model(cfg: DictConfig, device: torch.device, meshes: Meshes | None, strategy: str) -> BuiltModel:
    """The model of this run, built, placed (and sharded) for ``strategy`` and initialised from ``cfg.seed``'s RNG.

    ``meshes`` may be None for ``"ddp"`` (it uses the default process group, if any).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    settle_masters_in_optimizer(cfg, strategy, device)  # FSDP2 keeps its own fp32 master weights
    config, plan = load_model_config(cfg)
    check_quantization_supported(plan, device)  # FP8/FP4 on a machine that cannot run it fails here
    try:
        resolve_backend(config.backend)  # backend=te on a machine without TE or a GPU fails here, in one line
    except RuntimeError as error:
        raise UnsupportedHardwareError(f"{error} (+model_config_overrides.backend=torch)") from None
    on_meta = strategy == "fsdp2" and cfg.fsdp.use_meta_device
    if strategy == "fsdp2":
        with torch.device("meta" if on_meta else device):
            model = NVLlamaForCausalLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    else:
        model = NVLlamaForCausalLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe).to(device)
    master_low_bits = None
    if holds_masters_in_optimizer(cfg.mixed_precision, device):
        master_low_bits = split_float32_masters(model)  # bf16 weights; the fp32 low bits go to CompensatedAdamW
    elif computes_in_bf16(cfg.mixed_precision, device) and not keeps_fp32_master_weights(cfg.mixed_precision, device):
        model.to(torch.bfloat16)  # bf16 weights and optimizer state: less memory, no fp32 master copy
    model_flops = ModelFlops.from_model(model, config.num_hidden_layers, config.hidden_size)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    fused = model.backend == "te" and config.fused_residual_norm  # after fused_layer_choice may have turned it off
    layers = (
        " (FusedResidualTransformerLayer: residual adds in the RMSNorm kernels, RoPE in the QKV buffer)"
        if fused
        else ""
    )
    logger.info("Model: %s backend%s, %.1fM parameters%s", model.backend, layers, millions, recompute_note(config))

    if meshes is not None and meshes.cp is not None:
        # Every attention layer exchanges K/V blocks with the other ranks of this rank's CP group.
        cp_group = meshes.cp.get_group()
        cp_stream = torch.cuda.Stream() if device.type == "cuda" else None
        model.model.set_context_parallel_group(cp_group, dist.get_process_group_ranks(cp_group), cp_stream)

    ddp = None
    if strategy == "fsdp2":
        # FSDP2 over meshes.fsdp (dp x cp with context parallelism: CP ranks hold the same weights).
        policy = mixed_precision_policy(cfg.mixed_precision, device)
        reshard = cfg.fsdp.reshard_after_forward
        for layer in model.model.layers:
            fully_shard(layer, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard)
        if on_meta:
            model.init_empty_weights(device)
        train_model = model
    else:
        # The same random init on every rank (same seed), and DDP broadcasts rank 0's weights anyway. The buffers
        # (rotary frequencies) never change: no per-step broadcast.
        ddp = data_parallel_wrapper(model, device, float32_average=master_low_bits is not None)  # None: one process
        train_model = ddp or model
    if cfg.use_torch_compile:
        train_model = torch.compile(train_model)
    return BuiltModel(
        model, train_model, config, plan, model_flops, strategy, ddp, cfg.fsdp.reshard_after_backward, master_low_bits
    )
