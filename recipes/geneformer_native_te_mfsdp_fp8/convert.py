# Copied from models/geneformer/geneformer_te/convert.py — edit the source, then run ci/check_copies.py --fix
"""Convert between Hugging Face ``BertForMaskedLM`` (the layout of the published Geneformer checkpoints) and
``NVGeneformerForMaskedLM``; a round trip is exact.

The two differ in three places: TE fuses Q, K and V into one interleaved weight ([heads, 3, head_dim] rows), names
the post-norm LayerNorms after the TE modules that hold them (the attention's output norm is the LayerNormMLP's input
norm, the layer's output norm is ``layernorm``), and pads the vocabulary (word-embedding rows, LM-head bias) to a
multiple of 64. Everything else maps one to one.
"""

import re

from transformers import BertConfig, BertForMaskedLM


try:  # package import (models/geneformer)
    from .modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM
    from .weight_conversion import (
        NV_ONLY_CONFIG_KEYS,
        interleave_qkv,
        load_state_dict_exactly,
        pad_rows,
        split_qkv,
        translate_config,
    )
except ImportError:  # flat copy inside a recipe folder
    from modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM
    from weight_conversion import (
        NV_ONLY_CONFIG_KEYS,
        interleave_qkv,
        load_state_dict_exactly,
        pad_rows,
        split_qkv,
        translate_config,
    )


# Hugging Face key suffix inside `bert.encoder.layer.{i}.` -> NV key suffix inside `bert.encoder.layers.{i}.`
_LAYER_KEY_MAP = {
    "attention.output.dense.weight": "self_attention.proj.weight",
    "attention.output.dense.bias": "self_attention.proj.bias",
    "attention.output.LayerNorm.weight": "layernorm_mlp.layer_norm_weight",
    "attention.output.LayerNorm.bias": "layernorm_mlp.layer_norm_bias",
    "intermediate.dense.weight": "layernorm_mlp.fc1_weight",
    "intermediate.dense.bias": "layernorm_mlp.fc1_bias",
    "output.dense.weight": "layernorm_mlp.fc2_weight",
    "output.dense.bias": "layernorm_mlp.fc2_bias",
    "output.LayerNorm.weight": "layernorm.weight",
    "output.LayerNorm.bias": "layernorm.bias",
}
# Hugging Face key -> NV key, outside the layers.
_SHARED_KEY_MAP = {
    "bert.embeddings.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight": "bert.embeddings.layer_norm.weight",
    "bert.embeddings.LayerNorm.bias": "bert.embeddings.layer_norm.bias",
    "cls.predictions.transform.dense.weight": "lm_head.dense.weight",
    "cls.predictions.transform.dense.bias": "lm_head.dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "lm_head.layer_norm.weight",
    "cls.predictions.transform.LayerNorm.bias": "lm_head.layer_norm.bias",
}
# Tied to the word embeddings / to cls.predictions.bias in BertForMaskedLM; written from those.
_TIED_HF_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
_QKV = ("query", "key", "value")


def nv_config_from_hf(hf_config: BertConfig, **overrides) -> NVGeneformerConfig:
    return translate_config(hf_config, NVGeneformerConfig, **overrides)


def hf_config_from_nv(nv_config: NVGeneformerConfig) -> BertConfig:
    return translate_config(nv_config, BertConfig, drop=(*NV_ONLY_CONFIG_KEYS, "mask_token_id"))


def convert_geneformer_hf_to_te(hf_model: BertForMaskedLM, **config_overrides) -> NVGeneformerForMaskedLM:
    """Build an ``NVGeneformerForMaskedLM`` holding ``hf_model``'s weights; ``config_overrides`` set e.g. ``backend``."""
    config = nv_config_from_hf(hf_model.config, **config_overrides)
    if not config.tie_word_embeddings:
        raise ValueError(
            "Geneformer ties its MLM decoder to the word embeddings; tie_word_embeddings=False is not supported"
        )
    hf_state = hf_model.state_dict()
    num_heads = config.num_attention_heads
    state = {nv_key: hf_state[hf_key] for hf_key, nv_key in _SHARED_KEY_MAP.items()}
    state["bert.embeddings.word_embeddings.weight"] = pad_rows(
        hf_state["bert.embeddings.word_embeddings.weight"], config.padded_vocab_size
    )
    state["lm_head.bias"] = pad_rows(hf_state["cls.predictions.bias"], config.padded_vocab_size)
    for i in range(config.num_hidden_layers):
        hf_prefix, nv_prefix = f"bert.encoder.layer.{i}.", f"bert.encoder.layers.{i}."
        for hf_suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[nv_prefix + nv_suffix] = hf_state[hf_prefix + hf_suffix]
        for kind in ("weight", "bias"):
            q, k, v = (hf_state[f"{hf_prefix}attention.self.{name}.{kind}"] for name in _QKV)
            state[f"{nv_prefix}self_attention.qkv.{kind}"] = interleave_qkv(q, k, v, num_groups=num_heads)
    known = {*_SHARED_KEY_MAP, *_TIED_HF_KEYS, "bert.embeddings.word_embeddings.weight", "cls.predictions.bias"}
    layer_key = re.compile(r"bert\.encoder\.layer\.(\d+)\.(.+)")
    layer_suffixes = {*_LAYER_KEY_MAP, *(f"attention.self.{n}.{k}" for n in _QKV for k in ("weight", "bias"))}

    def is_known(key: str) -> bool:
        match = layer_key.fullmatch(key)
        if match:
            return int(match.group(1)) < config.num_hidden_layers and match.group(2) in layer_suffixes
        return key in known

    unknown = sorted(key for key in hf_state if not is_known(key))
    if unknown:
        raise ValueError(f"Hugging Face checkpoint has weights this conversion does not know: {unknown[:5]}")

    nv_model = NVGeneformerForMaskedLM(config)
    state["lm_head.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]  # tied
    load_state_dict_exactly(nv_model, state, "Hugging Face BertForMaskedLM (Geneformer) weights")
    return nv_model.to(dtype=next(hf_model.parameters()).dtype)


def convert_geneformer_te_to_hf(nv_model: NVGeneformerForMaskedLM) -> BertForMaskedLM:
    """Build a stock Hugging Face ``BertForMaskedLM`` holding ``nv_model``'s weights."""
    config = nv_model.config
    nv_state = {k: v for k, v in nv_model.state_dict().items() if not k.endswith("_extra_state")}
    vocab = config.vocab_size
    state = {hf_key: nv_state[nv_key] for hf_key, nv_key in _SHARED_KEY_MAP.items()}
    state["bert.embeddings.word_embeddings.weight"] = nv_state["bert.embeddings.word_embeddings.weight"][:vocab]
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.bias"] = nv_state["lm_head.bias"][:vocab]
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    layer_pattern = re.compile(r"bert\.encoder\.layers\.(\d+)\.(.+)")
    nv_to_hf = {v: k for k, v in _LAYER_KEY_MAP.items()}
    for key, value in nv_state.items():
        match = layer_pattern.fullmatch(key)
        if not match:
            continue
        index, suffix = match.groups()
        hf_prefix = f"bert.encoder.layer.{index}."
        if suffix in nv_to_hf:
            state[hf_prefix + nv_to_hf[suffix]] = value
        elif suffix.startswith("self_attention.qkv."):
            kind = suffix.rsplit(".", 1)[1]
            for name, part in zip(_QKV, split_qkv(value, config.num_attention_heads, config.num_attention_heads)):
                state[f"{hf_prefix}attention.self.{name}.{kind}"] = part
        else:
            raise ValueError(f"NVGeneformer checkpoint key {key!r} has no Hugging Face counterpart")

    hf_model = BertForMaskedLM(hf_config_from_nv(config))
    load_state_dict_exactly(hf_model, state, "NVGeneformer weights")
    hf_model.tie_weights()
    return hf_model.to(dtype=next(nv_model.parameters()).dtype)
