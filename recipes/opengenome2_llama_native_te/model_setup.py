"""Everything train_fsdp2.py needs to turn the config into a sharded, initialised model.

- ``load_model_config``: ``config.json`` from ``model_tag`` plus ``model_config_overrides`` (the init switches
  ``embedding_init_std`` and ``scale_output_projection_init`` are model-config fields and live there), and the
  per-layer FP8 plan, with ``fp8_config.keep_first_last_bf16`` turned into the list of FP8 layers;
- ``mixed_precision_policy``: fp32 master weights, bf16 compute, fp32 gradient reduction;
- ``build_model``: meta-device construction, FSDP2 sharding per layer, then initialisation of each rank's shards.
"""

from pathlib import Path

import hydra
import torch
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from omegaconf import DictConfig, OmegaConf
from quantization import QuantizationPlan, build_quantization
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


RECIPE_DIR = Path(__file__).resolve().parent


def recipe_path(path: str) -> Path:
    """A path as given when it exists from the working directory, else relative to this recipe folder."""
    return Path(path) if Path(path).exists() or Path(path).is_absolute() else RECIPE_DIR / path


def fp8_layers_keeping_first_last_bf16(num_layers: int, keep: int) -> list[int]:
    """The 1-indexed FP8 layers when the first ``keep`` and the last ``keep`` layers stay in bf16.

    The first layers see raw embeddings and the last ones feed the LM head: their activations have the widest
    dynamic range, where FP8's 3-bit mantissa costs the most accuracy (a common stabiliser for FP8 pre-training).
    """
    if keep < 0:
        raise ValueError(f"fp8_config.keep_first_last_bf16 must be >= 0, got {keep}")
    if 2 * keep >= num_layers:
        raise ValueError(f"fp8_config.keep_first_last_bf16={keep} leaves no FP8 layer in a {num_layers}-layer model")
    return list(range(keep + 1, num_layers - keep + 1))


def load_model_config(cfg: DictConfig) -> tuple[NVLlamaConfig, QuantizationPlan]:
    """config.json from ``model_tag``, this run's overrides, and the per-layer FP8/FP4 plan the model needs."""
    model_dir = recipe_path(cfg.model_tag)
    overrides = OmegaConf.to_container(cfg.model_config_overrides)
    unknown = sorted(set(overrides) - set(NVLlamaConfig.from_pretrained(model_dir).to_dict()))
    if unknown:
        raise ValueError(f"model_config_overrides has keys {unknown} that {model_dir}/config.json does not have")
    config = NVLlamaConfig.from_pretrained(model_dir, **overrides)
    if config.embedding_init_std is not None and config.tie_word_embeddings:
        # A tied LM head would share the unit-scale init: initial logits of std ~sqrt(hidden_size).
        raise ValueError(
            f"embedding_init_std={config.embedding_init_std} (Spike No More) needs untied embeddings: set "
            "model_config_overrides.tie_word_embeddings=false"
        )

    fp8_config = OmegaConf.to_container(cfg.fp8_config)
    keep = fp8_config.pop("keep_first_last_bf16", 0)
    if keep:
        if not fp8_config["enabled"]:
            raise ValueError("fp8_config.keep_first_last_bf16 is set but fp8_config.enabled is false")
        if fp8_config.get("fp8_layers"):
            raise ValueError("set either fp8_config.fp8_layers or fp8_config.keep_first_last_bf16, not both")
        fp8_config["fp8_layers"] = fp8_layers_keeping_first_last_bf16(config.num_hidden_layers, keep)
    plan = build_quantization(fp8_config, OmegaConf.to_container(cfg.fp4_config), config.num_hidden_layers)
    config.layer_precision = plan.layer_precision
    config.validate_nv_llama()
    return config, plan


def mixed_precision_policy(cfg: DictConfig, device: torch.device) -> MixedPrecisionPolicy:
    """fp32 sharded master weights, cast to bf16 per layer for compute; gradients reduced in fp32.

    ``cast_forward_inputs=False``: FSDP2 would otherwise cast every floating-point argument of a sharded layer to bf16,
    including the rotary-embedding table the model passes to each layer. RoPE angles at positions in the thousands
    need fp32 (bf16 keeps 8 bits of mantissa: position 8,000's angle would be off by whole radians).
    """
    if cfg.mixed_precision.enabled and (device.type == "cuda" or cfg.mixed_precision.on_cpu):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def build_model(
    config: NVLlamaConfig,
    plan: QuantizationPlan,
    device: torch.device,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    use_meta_device: bool = True,
    reshard_after_forward: bool = True,
    seed: int = 42,
) -> NVLlamaForCausalLM:
    """Build, shard (each layer, then the root: embeddings, final norm, LM head) and initialise the model.

    On the meta device nothing is allocated until ``init_empty_weights`` fills each rank's shards: each rank keeps
    its slice of one full-size init, so any number of ranks starts from the weights one process would.
    """
    torch.manual_seed(seed)
    with torch.device("meta" if use_meta_device else device):
        model = NVLlamaForCausalLM(config, fp8_recipe=plan.fp8_recipe, fp4_recipe=plan.fp4_recipe)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    if use_meta_device:
        model.init_empty_weights(device)
    return model


def config_name() -> str:
    """The Hydra config this run started from (recorded in summary.json)."""
    return hydra.core.hydra_config.HydraConfig.get().job.config_name


def pad_token_id(tokenizer) -> int:
    """What padding looks like in a batch: the tokenizer's pad token, or ``<eos>`` for tokenizers without one."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
