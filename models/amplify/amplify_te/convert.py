"""Convert between a published AMPLIFY checkpoint (its state dict and config.json) and ``NVAmplifyForMaskedLM``.

The published layout (chandar-lab/AMPLIFY_120M, AMPLIFY_350M), per layer ``i``::

    encoder.weight                                   [vocab, hidden]      the embedding
    transformer_encoder.{i}.attention_norm.weight    [hidden]             RMSNorm before attention
    transformer_encoder.{i}.q/k/v/wo.weight          [hidden, hidden]     no biases
    transformer_encoder.{i}.ffn_norm.weight          [hidden]             RMSNorm before the FFN
    transformer_encoder.{i}.ffn.w12.weight           [2 * d_ff, hidden]   SwiGLU gate and value, packed
    transformer_encoder.{i}.ffn.w3.weight            [hidden, d_ff]
    layer_norm_1.weight                              [hidden]             only with layer_norm_after_embedding
    layer_norm_2.weight                              [hidden]             only with layer_norm_before_last_layer
    decoder.weight, decoder.bias                     [vocab, hidden], [vocab]

The NV model differs in three places: TE fuses Q, K and V into one interleaved weight ([heads, 3, head_dim] rows);
the rows of Q and K are permuted inside every head from the published interleaved rotary layout to the half-split one
(see the modeling file's docstring: an exact reparametrisation); and the vocabulary is padded to a multiple of 64
(embedding and decoder rows, decoder bias). Everything else maps one to one, so a round trip is exact.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file


try:  # package import (models/amplify)
    from .modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM
    from .weight_conversion import interleave_qkv, load_state_dict_exactly, pad_rows, split_qkv
except ImportError:  # flat copy inside a recipe folder
    from modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM
    from weight_conversion import interleave_qkv, load_state_dict_exactly, pad_rows, split_qkv


# Published key suffix inside `transformer_encoder.{i}.` -> NV key suffix inside `amplify.layers.{i}.`
_LAYER_KEY_MAP = {
    "attention_norm.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "wo.weight": "self_attention.proj.weight",
    "ffn_norm.weight": "layernorm_mlp.layer_norm_weight",
    "ffn.w12.weight": "layernorm_mlp.fc1_weight",
    "ffn.w3.weight": "layernorm_mlp.fc2_weight",
}
_QKV = ("q", "k", "v")
# Published key -> NV key, for the weights outside the layers that map one to one (the optional norms).
_NORM_KEY_MAP = {
    "layer_norm_1.weight": "amplify.embedding_norm.weight",
    "layer_norm_2.weight": "amplify.final_norm.weight",
}

# Fields of a published config.json that say which class or file it came from, not what the model is.
_PUBLISHED_BOOKKEEPING_KEYS = (
    "model_type",
    "architectures",
    "auto_map",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "vocab_path",
)
# What convert_amplify_te_to_hf writes besides the model's settings, as the published config.json has it.
_PUBLISHED_IDENTITY = {"model_type": "AMPLIFY", "architectures": ["AMPLIFY"]}
PUBLISHED_ROPE_THETA = 10000.0  # the published code's fixed rotary base (its config has no such field)


# ------------------------------------------------------------------------------------- rotary channel permutation


def _rotary_permutation(head_dim: int) -> torch.Tensor:
    """Published channel of each NV channel within a head: [0, 2, 4, ..., 1, 3, 5, ...] (pairs (2i, 2i+1) -> (i,
    i + head_dim / 2))."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def interleaved_to_half_split(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Q or K rows of the published (interleaved rotary) layout -> the half-split layout, head by head."""
    head_dim = weight.shape[0] // num_heads
    per_head = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return per_head[:, _rotary_permutation(head_dim)].reshape(weight.shape)


def half_split_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half_split`."""
    head_dim = weight.shape[0] // num_heads
    inverse = torch.argsort(_rotary_permutation(head_dim))
    per_head = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return per_head[:, inverse].reshape(weight.shape)


# --------------------------------------------------------------------------------------------------------- config


def nv_config_from_published(published: Mapping | object, **overrides) -> NVAmplifyConfig:
    """``NVAmplifyConfig`` from a published config.json (a dict, or a config object with ``to_dict``)."""
    values = dict(published.to_dict() if hasattr(published, "to_dict") else published)
    values = {k: v for k, v in values.items() if k not in _PUBLISHED_BOOKKEEPING_KEYS}
    return NVAmplifyConfig(**{**values, **overrides})


def published_config_from_nv(config: NVAmplifyConfig) -> dict:
    """The published config.json fields of ``config`` (``model_type`` "AMPLIFY", no NV-only settings)."""
    published_fields = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "dropout_prob",
        "embedding_init_range",
        "decoder_init_range",
        "rms_norm",
        "norm_eps",
        "hidden_act",
        "layer_norm_after_embedding",
        "layer_norm_before_last_layer",
        "vocab_size",
        "ffn_bias",
        "att_bias",
        "pad_token_id",
        "unk_token_id",
        "mask_token_id",
        "bos_token_id",
        "eos_token_id",
        "other_special_token_ids",
        "max_length",
    ]
    return {**_PUBLISHED_IDENTITY, **{key: getattr(config, key) for key in published_fields}}


# ----------------------------------------------------------------------------------------------------- conversion


def _published_keys(config: NVAmplifyConfig) -> set[str]:
    keys = {"encoder.weight", "decoder.weight", "decoder.bias"}
    if config.layer_norm_after_embedding:
        keys.add("layer_norm_1.weight")
    if config.layer_norm_before_last_layer:
        keys.add("layer_norm_2.weight")
    for i in range(config.num_hidden_layers):
        keys |= {f"transformer_encoder.{i}.{suffix}" for suffix in _LAYER_KEY_MAP}
        keys |= {f"transformer_encoder.{i}.{name}.weight" for name in _QKV}
    return keys


def convert_amplify_hf_to_te(
    state_dict: Mapping[str, torch.Tensor], config: Mapping | object, **config_overrides
) -> NVAmplifyForMaskedLM:
    """Build an ``NVAmplifyForMaskedLM`` holding a published AMPLIFY checkpoint's weights.

    ``state_dict`` is the checkpoint's own (model.safetensors or pytorch_model.bin), ``config`` its config.json (a
    dict) or config object; ``config_overrides`` set e.g. ``backend``. Missing or extra weights are named.
    """
    config = nv_config_from_published(config, **config_overrides)
    expected = _published_keys(config)
    missing, unexpected = sorted(expected - state_dict.keys()), sorted(state_dict.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            "the AMPLIFY checkpoint does not match its config "
            f"({config.num_hidden_layers} layers, layer_norm_after_embedding={config.layer_norm_after_embedding}, "
            f"layer_norm_before_last_layer={config.layer_norm_before_last_layer}): "
            f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    heads = config.num_attention_heads
    state = {
        "amplify.embeddings.weight": pad_rows(state_dict["encoder.weight"], config.padded_vocab_size),
        "decoder.weight": pad_rows(state_dict["decoder.weight"], config.padded_vocab_size),
        "decoder.bias": pad_rows(state_dict["decoder.bias"], config.padded_vocab_size),
    }
    state |= {nv: state_dict[published] for published, nv in _NORM_KEY_MAP.items() if published in state_dict}
    for i in range(config.num_hidden_layers):
        published_prefix, nv_prefix = f"transformer_encoder.{i}.", f"amplify.layers.{i}."
        for published_suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[nv_prefix + nv_suffix] = state_dict[published_prefix + published_suffix]
        q, k, v = (state_dict[f"{published_prefix}{name}.weight"] for name in _QKV)
        q, k = interleaved_to_half_split(q, heads), interleaved_to_half_split(k, heads)
        state[f"{nv_prefix}self_attention.layernorm_qkv.weight"] = interleave_qkv(q, k, v, num_groups=heads)

    dtype = state_dict["encoder.weight"].dtype
    nv_model = NVAmplifyForMaskedLM(config)
    load_state_dict_exactly(nv_model, state, "the published AMPLIFY weights")
    return nv_model.to(dtype=dtype)


def convert_amplify_te_to_hf(model: NVAmplifyForMaskedLM) -> tuple[dict[str, torch.Tensor], dict]:
    """The published layout of ``model``: (state dict, config.json fields). The inverse of the conversion above."""
    config = model.config
    if config.rope_theta != PUBLISHED_ROPE_THETA:
        # The published code has no such setting: its rotary base is fixed, so the checkpoint would compute otherwise.
        raise ValueError(
            f"this model uses rope_theta={config.rope_theta}; the published AMPLIFY layout fixes the rotary base at "
            f"{PUBLISHED_ROPE_THETA:g}, so it cannot hold this model"
        )
    nv_state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    vocab, heads = config.vocab_size, config.num_attention_heads
    state = {
        "encoder.weight": nv_state.pop("amplify.embeddings.weight")[:vocab],
        "decoder.weight": nv_state.pop("decoder.weight")[:vocab],
        "decoder.bias": nv_state.pop("decoder.bias")[:vocab],
    }
    for published, nv in _NORM_KEY_MAP.items():
        if nv in nv_state:
            state[published] = nv_state.pop(nv)
    for i in range(config.num_hidden_layers):
        published_prefix, nv_prefix = f"transformer_encoder.{i}.", f"amplify.layers.{i}."
        for published_suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[published_prefix + published_suffix] = nv_state.pop(nv_prefix + nv_suffix)
        q, k, v = split_qkv(nv_state.pop(f"{nv_prefix}self_attention.layernorm_qkv.weight"), heads, heads)
        state[f"{published_prefix}q.weight"] = half_split_to_interleaved(q, heads)
        state[f"{published_prefix}k.weight"] = half_split_to_interleaved(k, heads)
        state[f"{published_prefix}v.weight"] = v
    if nv_state:
        raise ValueError(f"NVAmplify weights without a published counterpart: {sorted(nv_state)[:8]}")
    # Plain contiguous tensors, so that the state dict saves as it is (safetensors refuses views of a larger buffer).
    return {k: v.contiguous().clone() for k, v in state.items()}, published_config_from_nv(config)


# ------------------------------------------------------------------------------------------- published checkpoints


def _local_checkpoint(source: str | Path) -> Path:
    """A local directory, or a Hub id fetched (config and weights only) into the Hugging Face cache."""
    if Path(source).exists():
        return Path(source)
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "model.safetensors", "pytorch_model.bin"]
    return Path(snapshot_download(str(source), allow_patterns=patterns))


def load_published_checkpoint(source: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json) of a published AMPLIFY checkpoint directory or Hub id."""
    directory = _local_checkpoint(source)
    config = json.loads((directory / "config.json").read_text())
    if (directory / "model.safetensors").is_file():
        state_dict = load_file(directory / "model.safetensors")
    elif (directory / "pytorch_model.bin").is_file():
        state_dict = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{directory} holds neither model.safetensors nor pytorch_model.bin")
    return state_dict, config


__all__ = [
    "convert_amplify_hf_to_te",
    "convert_amplify_te_to_hf",
    "half_split_to_interleaved",
    "interleaved_to_half_split",
    "load_published_checkpoint",
    "nv_config_from_published",
    "published_config_from_nv",
]
