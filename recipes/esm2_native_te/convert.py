# Copied from models/esm2/esm2_te/convert.py — edit the source, then run ci/check_copies.py --fix
"""Convert between Hugging Face ``EsmForMaskedLM`` and ``NVEsmForMaskedLM``; a round trip is exact.

The two differ in three places: TE fuses Q, K and V into one interleaved weight ([heads, 3, head_dim] rows),
renames the LayerNorms after the layers they feed, and pads the vocabulary (embedding rows, LM-head bias) to a
multiple of 64. Everything else maps one to one.
"""

import re

from transformers import EsmConfig, EsmForMaskedLM


try:  # package import (models/esm2)
    from .modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM
    from .weight_conversion import (
        NV_ONLY_CONFIG_KEYS,
        interleave_qkv,
        load_state_dict_exactly,
        pad_rows,
        split_qkv,
        translate_config,
    )
except ImportError:  # flat copy inside a recipe folder
    from modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM
    from weight_conversion import (
        NV_ONLY_CONFIG_KEYS,
        interleave_qkv,
        load_state_dict_exactly,
        pad_rows,
        split_qkv,
        translate_config,
    )


# Hugging Face key suffix inside `esm.encoder.layer.{i}.` -> NVEsm key suffix inside `esm.encoder.layers.{i}.`
_LAYER_KEY_MAP = {
    "attention.LayerNorm.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "attention.LayerNorm.bias": "self_attention.layernorm_qkv.layer_norm_bias",
    "attention.output.dense.weight": "self_attention.proj.weight",
    "attention.output.dense.bias": "self_attention.proj.bias",
    "LayerNorm.weight": "layernorm_mlp.layer_norm_weight",
    "LayerNorm.bias": "layernorm_mlp.layer_norm_bias",
    "intermediate.dense.weight": "layernorm_mlp.fc1_weight",
    "intermediate.dense.bias": "layernorm_mlp.fc1_bias",
    "output.dense.weight": "layernorm_mlp.fc2_weight",
    "output.dense.bias": "layernorm_mlp.fc2_bias",
}
_SHARED_KEYS = [
    "esm.encoder.emb_layer_norm_after.weight",
    "esm.encoder.emb_layer_norm_after.bias",
    "esm.contact_head.regression.weight",
    "esm.contact_head.regression.bias",
    "lm_head.dense.weight",
    "lm_head.dense.bias",
    "lm_head.layer_norm.weight",
    "lm_head.layer_norm.bias",
]
_QKV = ("query", "key", "value")


def nv_config_from_hf(hf_config: EsmConfig, **overrides) -> NVEsmConfig:
    return translate_config(hf_config, NVEsmConfig, **overrides)


def hf_config_from_nv(nv_config: NVEsmConfig) -> EsmConfig:
    return translate_config(nv_config, EsmConfig, drop=NV_ONLY_CONFIG_KEYS)


def convert_esm_hf_to_te(hf_model: EsmForMaskedLM, **config_overrides) -> NVEsmForMaskedLM:
    """Build an ``NVEsmForMaskedLM`` holding ``hf_model``'s weights; ``config_overrides`` set e.g. ``backend``."""
    if not hf_model.config.tie_word_embeddings:
        # NVEsm's LM head decodes with the word embeddings (as every published ESM-2 does): an untied decoder's own
        # weights would be dropped without a word.
        raise ValueError(
            "this ESM checkpoint has tie_word_embeddings=false (its own lm_head.decoder weights); NVEsm ties the "
            "decoder to the word embeddings, so it cannot hold them"
        )
    config = nv_config_from_hf(hf_model.config, **config_overrides)
    hf_state = hf_model.state_dict()
    num_heads = config.num_attention_heads
    state = {key: hf_state[key] for key in _SHARED_KEYS if key in hf_state}
    state["esm.embeddings.word_embeddings.weight"] = pad_rows(
        hf_state["esm.embeddings.word_embeddings.weight"], config.padded_vocab_size
    )
    state["lm_head.bias"] = pad_rows(hf_state["lm_head.bias"], config.padded_vocab_size)
    for i in range(config.num_hidden_layers):
        hf_prefix, nv_prefix = f"esm.encoder.layer.{i}.", f"esm.encoder.layers.{i}."
        for hf_suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[nv_prefix + nv_suffix] = hf_state[hf_prefix + hf_suffix]
        for kind in ("weight", "bias"):
            q, k, v = (hf_state[f"{hf_prefix}attention.self.{name}.{kind}"] for name in _QKV)
            state[f"{nv_prefix}self_attention.layernorm_qkv.{kind}"] = interleave_qkv(q, k, v, num_groups=num_heads)
    unknown = sorted(
        key
        for key in hf_state
        if not (
            key in state
            or key.startswith("esm.encoder.layer.")
            or key in ("esm.embeddings.word_embeddings.weight", "lm_head.bias", "lm_head.decoder.weight")
            or key.endswith("rotary_embeddings.inv_freq")  # recomputed from config.rope_theta
        )
    )
    if unknown:
        raise ValueError(f"Hugging Face checkpoint has weights this conversion does not know: {unknown[:5]}")

    nv_model = NVEsmForMaskedLM(config)
    state["lm_head.decoder.weight"] = state["esm.embeddings.word_embeddings.weight"]  # tied
    load_state_dict_exactly(nv_model, state, "Hugging Face ESM-2 weights")
    return nv_model.to(dtype=next(hf_model.parameters()).dtype)


def convert_esm_te_to_hf(nv_model: NVEsmForMaskedLM) -> EsmForMaskedLM:
    """Build a stock Hugging Face ``EsmForMaskedLM`` holding ``nv_model``'s weights."""
    config = nv_model.config
    hf_config = hf_config_from_nv(config)
    nv_state = {k: v for k, v in nv_model.state_dict().items() if not k.endswith("_extra_state")}
    vocab = config.vocab_size
    state = {key: nv_state[key] for key in _SHARED_KEYS}
    state["esm.embeddings.word_embeddings.weight"] = nv_state["esm.embeddings.word_embeddings.weight"][:vocab]
    state["lm_head.decoder.weight"] = state["esm.embeddings.word_embeddings.weight"]
    state["lm_head.bias"] = nv_state["lm_head.bias"][:vocab]
    layer_pattern = re.compile(r"esm\.encoder\.layers\.(\d+)\.(.+)")
    nv_to_hf = {v: k for k, v in _LAYER_KEY_MAP.items()}
    for key, value in nv_state.items():
        match = layer_pattern.fullmatch(key)
        if not match:
            continue
        index, suffix = match.groups()
        hf_prefix = f"esm.encoder.layer.{index}."
        if suffix in nv_to_hf:
            state[hf_prefix + nv_to_hf[suffix]] = value
        elif suffix.startswith("self_attention.layernorm_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            for name, part in zip(_QKV, split_qkv(value, config.num_attention_heads, config.num_attention_heads)):
                state[f"{hf_prefix}attention.self.{name}.{kind}"] = part
        else:
            raise ValueError(f"NVEsm checkpoint key {key!r} has no Hugging Face counterpart")

    hf_model = EsmForMaskedLM(hf_config)
    hf_state = hf_model.state_dict()
    for key in hf_state:  # buffers that HF computes from the config
        if key.endswith("rotary_embeddings.inv_freq") or key.endswith("position_ids"):
            state[key] = hf_state[key]
    load_state_dict_exactly(hf_model, state, "NVEsm weights")
    hf_model.tie_weights()
    return hf_model.to(dtype=next(nv_model.parameters()).dtype)
