# Copied from models/vit/vit_te/convert.py — edit the source, then run ci/check_copies.py --fix
"""Convert between Hugging Face ``ViTForImageClassification`` and ``NVViTForImageClassification``; a round trip is
exact.

The two differ only inside the encoder layers: TE fuses Q, K and V into one interleaved weight ([heads, 3, head_dim]
rows) and names each LayerNorm after the projection it feeds (``layernorm_before`` -> the QKV projection's norm,
``layernorm_after`` -> the MLP's). The embeddings, the final LayerNorm and the classifier keep their names.

The key names are those of the Hugging Face model object (transformers 5: ``vit.layers.{i}.attention.q_proj``);
``ViTForImageClassification.from_pretrained`` already renames the keys of older published checkpoints
(``vit.encoder.layer.{i}.attention.attention.query``) on load.
"""

import re

from transformers import ViTConfig, ViTForImageClassification


try:  # package import (models/vit)
    from .modeling_vit_te import NVViTConfig, NVViTForImageClassification
    from .weight_conversion import (
        NV_ONLY_CONFIG_KEYS,
        interleave_qkv,
        load_state_dict_exactly,
        split_qkv,
        translate_config,
    )
except ImportError:  # flat copy inside a recipe folder
    from modeling_vit_te import NVViTConfig, NVViTForImageClassification
    from weight_conversion import (
        NV_ONLY_CONFIG_KEYS,
        interleave_qkv,
        load_state_dict_exactly,
        split_qkv,
        translate_config,
    )


# Hugging Face key suffix inside `vit.layers.{i}.` -> NVViT key suffix inside `vit.encoder.layers.{i}.`
_LAYER_KEY_MAP = {
    "layernorm_before.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "layernorm_before.bias": "self_attention.layernorm_qkv.layer_norm_bias",
    "attention.o_proj.weight": "self_attention.proj.weight",
    "attention.o_proj.bias": "self_attention.proj.bias",
    "layernorm_after.weight": "layernorm_mlp.layer_norm_weight",
    "layernorm_after.bias": "layernorm_mlp.layer_norm_bias",
    "mlp.fc1.weight": "layernorm_mlp.fc1_weight",
    "mlp.fc1.bias": "layernorm_mlp.fc1_bias",
    "mlp.fc2.weight": "layernorm_mlp.fc2_weight",
    "mlp.fc2.bias": "layernorm_mlp.fc2_bias",
}
_SHARED_KEYS = (
    "vit.embeddings.cls_token",
    "vit.embeddings.position_embeddings",
    "vit.embeddings.patch_embeddings.projection.weight",
    "vit.embeddings.patch_embeddings.projection.bias",
    "vit.layernorm.weight",
    "vit.layernorm.bias",
    "classifier.weight",
    "classifier.bias",
)
_QKV = ("q_proj", "k_proj", "v_proj")


def nv_config_from_hf(hf_config: ViTConfig, **overrides) -> NVViTConfig:
    return translate_config(hf_config, NVViTConfig, **overrides)


def hf_config_from_nv(nv_config: NVViTConfig) -> ViTConfig:
    return translate_config(nv_config, ViTConfig, drop=NV_ONLY_CONFIG_KEYS)


def convert_vit_hf_to_te(hf_model: ViTForImageClassification, **config_overrides) -> NVViTForImageClassification:
    """Build an ``NVViTForImageClassification`` holding ``hf_model``'s weights; ``config_overrides`` set e.g.
    ``backend``."""
    config = nv_config_from_hf(hf_model.config, **config_overrides)
    hf_state = hf_model.state_dict()
    heads = config.num_attention_heads
    state = {key: hf_state[key] for key in _SHARED_KEYS if key in hf_state}
    for i in range(config.num_hidden_layers):
        hf_prefix, nv_prefix = f"vit.layers.{i}.", f"vit.encoder.layers.{i}."
        for hf_suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[nv_prefix + nv_suffix] = hf_state[hf_prefix + hf_suffix]
        for kind in ("weight", "bias"):
            q, k, v = (hf_state[f"{hf_prefix}attention.{name}.{kind}"] for name in _QKV)
            state[f"{nv_prefix}self_attention.layernorm_qkv.{kind}"] = interleave_qkv(q, k, v, num_groups=heads)
    unknown = sorted(key for key in hf_state if not (key in state or key.startswith("vit.layers.")))
    if unknown:
        raise ValueError(
            f"the Hugging Face ViT has weights this conversion does not know: {unknown[:5]} (a pooler or mask token: "
            "convert a ViTForImageClassification, which has neither)"
        )
    nv_model = NVViTForImageClassification(config)
    load_state_dict_exactly(nv_model, state, "Hugging Face ViT weights")
    return nv_model.to(dtype=next(hf_model.parameters()).dtype)


def convert_vit_te_to_hf(nv_model: NVViTForImageClassification) -> ViTForImageClassification:
    """Build a stock Hugging Face ``ViTForImageClassification`` holding ``nv_model``'s weights."""
    config = nv_model.config
    nv_state = {k: v for k, v in nv_model.state_dict().items() if not k.endswith("_extra_state")}
    state = {key: nv_state[key] for key in _SHARED_KEYS}
    layer_pattern = re.compile(r"vit\.encoder\.layers\.(\d+)\.(.+)")
    nv_to_hf = {v: k for k, v in _LAYER_KEY_MAP.items()}
    for key, value in nv_state.items():
        if key in state:
            continue
        match = layer_pattern.fullmatch(key)
        if not match:
            raise ValueError(f"NVViT checkpoint key {key!r} has no Hugging Face counterpart")
        index, suffix = match.groups()
        hf_prefix = f"vit.layers.{index}."
        if suffix in nv_to_hf:
            state[hf_prefix + nv_to_hf[suffix]] = value
        elif suffix in ("self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            heads = config.num_attention_heads
            for name, part in zip(_QKV, split_qkv(value, heads, heads)):
                state[f"{hf_prefix}attention.{name}.{kind}"] = part
        else:
            raise ValueError(f"NVViT checkpoint key {key!r} has no Hugging Face counterpart")
    hf_model = ViTForImageClassification(hf_config_from_nv(config))
    load_state_dict_exactly(hf_model, state, "NVViT weights")
    return hf_model.to(dtype=next(nv_model.parameters()).dtype)
