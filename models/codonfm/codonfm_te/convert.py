"""Convert between a published Encodon checkpoint (CodonFM's Lightning ``EncodonPL``) and ``NVEncodonForMaskedLM``.

The published layout (``EncodonPL.model`` is an ``EnCodon``; a Lightning .ckpt prefixes every key with ``model.``),
per layer ``i``::

    embeddings.word_embeddings.weight                [vocab, hidden]      padding row pad_token_id
    embeddings.post_ln.{weight,bias}                 [hidden]
    layers.{i}.pre_attn_layer_norm.{weight,bias}     [hidden]
    layers.{i}.attention.{query,key,value}.{weight,bias}   [hidden, hidden], [hidden]
    layers.{i}.attention.rotary_emb.inv_freq         [head_dim / 2]       a buffer: 1 / theta^(2j / head_dim)
    layers.{i}.post_attn_layer_norm.{weight,bias}    [hidden]
    layers.{i}.post_attn_dense.{weight,bias}         [hidden, hidden], [hidden]
    layers.{i}.pre_ffn_layer_norm.{weight,bias}      [hidden]
    layers.{i}.intermediate_dense.{weight,bias}      [ffn, hidden], [ffn]
    layers.{i}.post_ffn_layer_norm.{weight,bias}     [ffn]
    layers.{i}.output_dense.{weight,bias}            [hidden, ffn], [hidden]
    cls.0.{weight,bias}, cls.2.{weight,bias}, cls.3.{weight,bias}   dense, LayerNorm, decoder [vocab, hidden]

and the checkpoint's ``hyper_parameters`` are EncodonPL's init arguments (vocab_size, hidden_size, ..., rotary_theta,
max_position_embeddings; the optimizer, scheduler and fine-tuning settings are not the model's and are ignored).

The NV model differs in three places: TE fuses each layer's Q, K and V (weights and biases) into one interleaved
projection behind the pre-attention LayerNorm; the rotary ``inv_freq`` is not stored (it is recomputed from
``rotary_theta``, and the conversion checks that the stored one agrees); and the vocabulary is padded to a multiple
of 64 (embedding and decoder rows, decoder bias). Everything else maps one to one, so a round trip is exact.
"""

import json
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file


try:  # package import (models/codonfm)
    from .modeling_codonfm_te import NVEncodonConfig, NVEncodonForMaskedLM, NVEncodonRotaryEmbedding
    from .weight_conversion import interleave_qkv, load_state_dict_exactly, pad_rows, split_qkv
except ImportError:  # flat copy inside a recipe folder
    from modeling_codonfm_te import NVEncodonConfig, NVEncodonForMaskedLM, NVEncodonRotaryEmbedding
    from weight_conversion import interleave_qkv, load_state_dict_exactly, pad_rows, split_qkv


LIGHTNING_PREFIX = "model."

# EncodonPL's init arguments that describe the network, with EncodonPL's defaults (what the published code builds
# when a checkpoint's hyper_parameters leave one out).
PUBLISHED_HPARAMS = {
    "vocab_size": 69,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 3,
    "rotary_theta": 1e4,
    "max_position_embeddings": 2048,
}

# Published key suffix inside `layers.{i}.` -> NV key suffix inside `encodon.layers.{i}.` (the one-to-one part).
_LAYER_KEY_MAP = {
    "pre_attn_layer_norm.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "pre_attn_layer_norm.bias": "self_attention.layernorm_qkv.layer_norm_bias",
    "post_attn_layer_norm.weight": "self_attention.proj.layer_norm_weight",
    "post_attn_layer_norm.bias": "self_attention.proj.layer_norm_bias",
    "post_attn_dense.weight": "self_attention.proj.weight",
    "post_attn_dense.bias": "self_attention.proj.bias",
    "pre_ffn_layer_norm.weight": "mlp.fc1.layer_norm_weight",
    "pre_ffn_layer_norm.bias": "mlp.fc1.layer_norm_bias",
    "intermediate_dense.weight": "mlp.fc1.weight",
    "intermediate_dense.bias": "mlp.fc1.bias",
    "post_ffn_layer_norm.weight": "mlp.fc2.layer_norm_weight",
    "post_ffn_layer_norm.bias": "mlp.fc2.layer_norm_bias",
    "output_dense.weight": "mlp.fc2.weight",
    "output_dense.bias": "mlp.fc2.bias",
}
_QKV = ("query", "key", "value")
_INV_FREQ = "attention.rotary_emb.inv_freq"
# Published key -> NV key outside the layers; the vocabulary-sized ones get padded rows.
_OUTER_KEY_MAP = {
    "embeddings.word_embeddings.weight": "encodon.embeddings.word_embeddings.weight",
    "embeddings.post_ln.weight": "encodon.embeddings.layer_norm.weight",
    "embeddings.post_ln.bias": "encodon.embeddings.layer_norm.bias",
    "cls.0.weight": "lm_head.dense.weight",
    "cls.0.bias": "lm_head.dense.bias",
    "cls.2.weight": "lm_head.layer_norm.weight",
    "cls.2.bias": "lm_head.layer_norm.bias",
    "cls.3.weight": "lm_head.decoder.weight",
    "cls.3.bias": "lm_head.decoder.bias",
}
_VOCAB_ROWS = ("embeddings.word_embeddings.weight", "cls.3.weight", "cls.3.bias")


# --------------------------------------------------------------------------------------------------------- config


def nv_config_from_hparams(hparams: Mapping, **overrides) -> NVEncodonConfig:
    """``NVEncodonConfig`` from a checkpoint's hyper_parameters (EncodonPL's init arguments; other keys ignored)."""
    hparams = dict(hparams)
    if isinstance(hparams.get("hparams"), Mapping):  # some Lightning versions nest them
        hparams = dict(hparams["hparams"])
    if hparams.get("use_downstream_head") or hparams.get("lora"):
        raise ValueError(
            "this Encodon checkpoint carries a cross-attention downstream head or LoRA adapters "
            "(use_downstream_head/lora in its hyper_parameters): only the pre-trained backbone and MLM head convert; "
            "merge or drop them first"
        )
    values = {key: hparams.get(key, default) for key, default in PUBLISHED_HPARAMS.items()}
    if not isinstance(values["hidden_act"], str):
        raise ValueError(f"hidden_act must be a name (gelu, relu, silu), got {values['hidden_act']!r}")
    return NVEncodonConfig(**{**values, **overrides})


def hparams_from_nv_config(config: NVEncodonConfig) -> dict:
    """The EncodonPL init arguments of ``config`` (what a Lightning checkpoint's hyper_parameters hold)."""
    return {key: getattr(config, key) for key in PUBLISHED_HPARAMS}


def rotary_inv_freq(config: NVEncodonConfig) -> torch.Tensor:
    """The published ``inv_freq`` buffer of ``config``: 1 / theta^(arange(0, head_dim, 2) / head_dim), float32."""
    return NVEncodonRotaryEmbedding(config.head_dim, config.rotary_theta).inv_freq


# ----------------------------------------------------------------------------------------------------- conversion


def _published_shapes(config: NVEncodonConfig) -> dict[str, tuple[int, ...]]:
    hidden, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {
        "embeddings.word_embeddings.weight": (vocab, hidden),
        "embeddings.post_ln.weight": (hidden,),
        "embeddings.post_ln.bias": (hidden,),
        "cls.0.weight": (hidden, hidden),
        "cls.0.bias": (hidden,),
        "cls.2.weight": (hidden,),
        "cls.2.bias": (hidden,),
        "cls.3.weight": (vocab, hidden),
        "cls.3.bias": (vocab,),
    }
    per_layer = {
        "pre_attn_layer_norm": (hidden,),
        "post_attn_layer_norm": (hidden,),
        "pre_ffn_layer_norm": (hidden,),
        "post_ffn_layer_norm": (ffn,),
    }
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}."
        for name, shape in per_layer.items():
            shapes[f"{prefix}{name}.weight"] = shapes[f"{prefix}{name}.bias"] = shape
        for name, (out, into) in {
            **{f"attention.{p}": (hidden, hidden) for p in _QKV},
            "post_attn_dense": (hidden, hidden),
            "intermediate_dense": (ffn, hidden),
            "output_dense": (hidden, ffn),
        }.items():
            shapes[f"{prefix}{name}.weight"], shapes[f"{prefix}{name}.bias"] = (out, into), (out,)
        shapes[prefix + _INV_FREQ] = (config.head_dim // 2,)
    return shapes


def strip_lightning_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EnCodon keys of a state dict given with (Lightning's ``model.``) or without the prefix."""
    return {k[len(LIGHTNING_PREFIX) :] if k.startswith(LIGHTNING_PREFIX) else k: v for k, v in state_dict.items()}


def _check_published_weights(state: Mapping[str, torch.Tensor], config: NVEncodonConfig) -> None:
    expected = _published_shapes(config)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs config {expected[k]}"
        for k in sorted(expected.keys() & state.keys())
        if tuple(state[k].shape) != expected[k]
    ]
    problems = [
        f"{label} ({len(keys)}): {keys[:8]}{' ...' if len(keys) > 8 else ''}"
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", mismatched))
        if keys
    ]
    if problems:
        raise ValueError(
            f"the Encodon checkpoint does not match its hyper_parameters ({config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, ffn {config.intermediate_size}, vocab {config.vocab_size}): " + "; ".join(problems)
        )
    expected_inv_freq = rotary_inv_freq(config)
    for i in range(config.num_hidden_layers):
        stored = state[f"layers.{i}.{_INV_FREQ}"]
        wanted = expected_inv_freq.to(stored.dtype).float()  # compare at the checkpoint's precision
        if not torch.allclose(stored.float(), wanted, rtol=1e-5, atol=0):
            raise ValueError(
                f"layers.{i}.{_INV_FREQ} is not the rotary table of rotary_theta={config.rotary_theta} "
                f"(stored {stored[:3].tolist()}..., expected {wanted[:3].tolist()}...): set rotary_theta in the "
                "hyper_parameters to the base the checkpoint was trained with"
            )


def convert_encodon_checkpoint_to_te(
    state_dict: Mapping[str, torch.Tensor], hparams: Mapping, **config_overrides
) -> NVEncodonForMaskedLM:
    """Build an ``NVEncodonForMaskedLM`` holding a published Encodon checkpoint's weights.

    ``state_dict`` is the checkpoint's (Lightning's ``state_dict``, keys with or without ``model.``), ``hparams`` its
    ``hyper_parameters`` (EncodonPL's init arguments); ``config_overrides`` set e.g. ``backend``. Missing, extra or
    wrongly shaped weights are named, and a stored rotary table that ``rotary_theta`` does not give is refused.
    """
    config = nv_config_from_hparams(hparams, **config_overrides)
    published = strip_lightning_prefix(state_dict)
    _check_published_weights(published, config)
    heads = config.num_attention_heads
    state = {}
    for key, nv_key in _OUTER_KEY_MAP.items():
        value = published[key]
        state[nv_key] = pad_rows(value, config.padded_vocab_size) if key in _VOCAB_ROWS else value
    for i in range(config.num_hidden_layers):
        prefix, nv_prefix = f"layers.{i}.", f"encodon.layers.{i}."
        for suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[nv_prefix + nv_suffix] = published[prefix + suffix]
        for kind in ("weight", "bias"):
            q, k, v = (published[f"{prefix}attention.{name}.{kind}"] for name in _QKV)
            state[f"{nv_prefix}self_attention.layernorm_qkv.{kind}"] = interleave_qkv(q, k, v, num_groups=heads)

    dtype = published["embeddings.word_embeddings.weight"].dtype
    nv_model = NVEncodonForMaskedLM(config)
    load_state_dict_exactly(nv_model, state, "the published Encodon weights")
    return nv_model.to(dtype=dtype)


def convert_encodon_te_to_checkpoint(model: NVEncodonForMaskedLM) -> tuple[dict[str, torch.Tensor], dict]:
    """``model`` in the published layout: (state dict with Lightning's ``model.`` keys, hyper_parameters). The
    inverse of :func:`convert_encodon_checkpoint_to_te`; the rotary ``inv_freq`` buffers are written in float32."""
    config = model.config
    nv_state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    vocab, heads = config.vocab_size, config.num_attention_heads
    state = {}
    for key, nv_key in _OUTER_KEY_MAP.items():
        value = nv_state.pop(nv_key)
        state[key] = value[:vocab] if key in _VOCAB_ROWS else value
    inv_freq = rotary_inv_freq(config)
    for i in range(config.num_hidden_layers):
        prefix, nv_prefix = f"layers.{i}.", f"encodon.layers.{i}."
        for suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[prefix + suffix] = nv_state.pop(nv_prefix + nv_suffix)
        for kind in ("weight", "bias"):
            fused = nv_state.pop(f"{nv_prefix}self_attention.layernorm_qkv.{kind}")
            for name, part in zip(_QKV, split_qkv(fused, heads, heads)):
                state[f"{prefix}attention.{name}.{kind}"] = part
        state[prefix + _INV_FREQ] = inv_freq.clone()
    if nv_state:
        raise ValueError(f"NVEncodon weights without a published counterpart: {sorted(nv_state)[:8]}")
    # Plain contiguous tensors, so that the state dict saves as it is (safetensors refuses views of a larger buffer).
    state = {LIGHTNING_PREFIX + k: v.contiguous().clone() for k, v in state.items()}
    return state, hparams_from_nv_config(config)


# ------------------------------------------------------------------------------------------- published checkpoints


class UntrustedCheckpointError(ValueError):
    """A Lightning checkpoint that holds pickled Python objects, which only a trusted load may execute."""


def _load_lightning_checkpoint(path: Path, trust_checkpoint: bool) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not trust_checkpoint:
            raise UntrustedCheckpointError(
                f"{path} holds pickled Python objects besides tensors (Lightning saves the optimizer and scheduler "
                "settings in hyper_parameters), and unpickling them runs code from the file: if you trust its source, "
                "pass trust_checkpoint=True (CLI: --trust-checkpoint)"
            ) from error
    return torch.load(path, map_location="cpu", weights_only=False)


def load_encodon_checkpoint(
    source: str | Path, trust_checkpoint: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, hyper_parameters) of a published Encodon checkpoint.

    ``source`` is a Lightning ``.ckpt`` file, a ``.safetensors`` file with a ``config.json`` (the hyper_parameters)
    beside it, or a directory holding ``model.safetensors`` (or ``pytorch_model.bin``) and ``config.json``. A .ckpt is
    read with ``weights_only=True`` first; one that holds pickled objects needs ``trust_checkpoint=True``.
    """
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"no Encodon checkpoint at {path}: give a .ckpt, a .safetensors or a directory")
    if path.is_file() and path.suffix == ".ckpt":
        checkpoint = _load_lightning_checkpoint(path, trust_checkpoint)
        if "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
            raise ValueError(f"{path} is not a Lightning checkpoint: it has no state_dict and hyper_parameters")
        return checkpoint["state_dict"], dict(checkpoint["hyper_parameters"])
    directory = path if path.is_dir() else path.parent
    weights = path if path.is_file() else directory / "model.safetensors"
    if path.is_dir() and not weights.is_file() and (directory / "pytorch_model.bin").is_file():
        weights = directory / "pytorch_model.bin"
    config_path = directory / "config.json"
    if not weights.is_file() or not config_path.is_file():
        raise FileNotFoundError(
            f"{path}: an Encodon checkpoint directory needs model.safetensors (or pytorch_model.bin) and config.json"
        )
    if weights.suffix == ".safetensors":
        state_dict = load_file(weights)
    else:
        state_dict = torch.load(weights, map_location="cpu", weights_only=True)
    return state_dict, json.loads(config_path.read_text())


__all__ = [
    "PUBLISHED_HPARAMS",
    "UntrustedCheckpointError",
    "convert_encodon_checkpoint_to_te",
    "convert_encodon_te_to_checkpoint",
    "hparams_from_nv_config",
    "load_encodon_checkpoint",
    "nv_config_from_hparams",
    "rotary_inv_freq",
    "strip_lightning_prefix",
]
