"""Convert between Hugging Face ``LlamaForCausalLM`` and ``NVLlamaForCausalLM``; a round trip is exact.

The two differ in three places: TE fuses Q, K and V into one interleaved weight (per key/value group: the
group's query heads, then its key head, then its value head), fuses the SwiGLU gate and up projections into
``fc1`` (gate first: TE applies SiLU to the first half), and names the RMSNorms after the layers they feed. The
vocabulary (embedding and LM-head rows) is padded to ``padded_vocab_size``. Everything else maps one to one.
"""

import copy
import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from .weight_conversion import (
    NV_ONLY_CONFIG_KEYS,
    interleave_qkv,
    load_state_dict_exactly,
    pad_rows,
    split_qkv,
    translate_config,
)


# Hugging Face key suffix inside `model.layers.{i}.` -> NVLlama key suffix inside the same prefix
_LAYER_KEY_MAP = {
    "input_layernorm.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": "self_attention.proj.weight",
    "post_attention_layernorm.weight": "layernorm_mlp.layer_norm_weight",
    "mlp.down_proj.weight": "layernorm_mlp.fc2_weight",
}
_FUSED_QKV = "self_attention.layernorm_qkv.weight"
_FUSED_FC1 = "layernorm_mlp.fc1_weight"


def nv_config_from_hf(hf_config: LlamaConfig, **overrides) -> NVLlamaConfig:
    return translate_config(hf_config, NVLlamaConfig, **overrides)


def hf_config_from_nv(nv_config: NVLlamaConfig) -> LlamaConfig:
    return translate_config(nv_config, LlamaConfig, drop=NV_ONLY_CONFIG_KEYS)


def convert_llama_hf_to_te(hf_model: LlamaForCausalLM, **config_overrides) -> NVLlamaForCausalLM:
    """Build an ``NVLlamaForCausalLM`` holding ``hf_model``'s weights; ``config_overrides`` set e.g. ``backend``."""
    config = nv_config_from_hf(hf_model.config, **config_overrides)
    hf_state = hf_model.state_dict()
    groups = config.num_key_value_heads
    state = {
        "model.norm.weight": hf_state["model.norm.weight"],
        "model.embed_tokens.weight": pad_rows(hf_state["model.embed_tokens.weight"], config.padded_vocab_size),
    }
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    else:
        state["lm_head.weight"] = pad_rows(hf_state["lm_head.weight"], config.padded_vocab_size)
    consumed = {"model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf_suffix, nv_suffix in _LAYER_KEY_MAP.items():
            state[prefix + nv_suffix] = hf_state[prefix + hf_suffix]
            consumed.add(prefix + hf_suffix)
        q, k, v = (hf_state[f"{prefix}self_attn.{name}_proj.weight"] for name in "qkv")
        state[prefix + _FUSED_QKV] = interleave_qkv(q, k, v, groups)
        gate, up = hf_state[f"{prefix}mlp.gate_proj.weight"], hf_state[f"{prefix}mlp.up_proj.weight"]
        state[prefix + _FUSED_FC1] = torch.cat([gate, up], dim=0)
        consumed |= {f"{prefix}self_attn.{name}_proj.weight" for name in "qkv"}
        consumed |= {f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"}
    unknown = sorted(k for k in hf_state if k not in consumed and not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"Hugging Face checkpoint has weights this conversion does not know: {unknown[:5]}")

    nv_model = NVLlamaForCausalLM(config)
    load_state_dict_exactly(nv_model, state, "Hugging Face Llama weights")
    if config.tie_word_embeddings:
        nv_model.tie_weights()
    # The checkpoint's generation settings (several <eos> ids, sampling defaults), not ones derived from the config.
    nv_model.generation_config = copy.deepcopy(hf_model.generation_config)
    return nv_model.to(dtype=next(hf_model.parameters()).dtype)


def convert_llama_te_to_hf(nv_model: NVLlamaForCausalLM) -> LlamaForCausalLM:
    """Build a stock Hugging Face ``LlamaForCausalLM`` holding ``nv_model``'s weights."""
    config = nv_model.config
    nv_state = {k: v for k, v in nv_model.state_dict().items() if not k.endswith("_extra_state")}
    vocab = config.vocab_size
    state = {
        "model.norm.weight": nv_state["model.norm.weight"],
        "model.embed_tokens.weight": nv_state["model.embed_tokens.weight"][:vocab],
        "lm_head.weight": nv_state["lm_head.weight"][:vocab],
    }
    layer_pattern = re.compile(r"model\.layers\.(\d+)\.(.+)")
    nv_to_hf = {v: k for k, v in _LAYER_KEY_MAP.items()}
    for key, value in nv_state.items():
        match = layer_pattern.fullmatch(key)
        if not match:
            if key not in state:
                raise ValueError(f"NVLlama checkpoint key {key!r} has no Hugging Face counterpart")
            continue
        index, suffix = match.groups()
        prefix = f"model.layers.{index}."
        if suffix in nv_to_hf:
            state[prefix + nv_to_hf[suffix]] = value
        elif suffix == _FUSED_QKV:
            parts = split_qkv(value, config.num_attention_heads, config.num_key_value_heads)
            for name, part in zip("qkv", parts):
                state[f"{prefix}self_attn.{name}_proj.weight"] = part
        elif suffix == _FUSED_FC1:
            gate, up = value.chunk(2, dim=0)
            state[f"{prefix}mlp.gate_proj.weight"], state[f"{prefix}mlp.up_proj.weight"] = gate, up
        else:
            raise ValueError(f"NVLlama checkpoint key {key!r} has no Hugging Face counterpart")

    hf_model = LlamaForCausalLM(hf_config_from_nv(config))
    load_state_dict_exactly(hf_model, state, "NVLlama weights")
    if config.tie_word_embeddings:
        hf_model.tie_weights()
    hf_model.generation_config = copy.deepcopy(nv_model.generation_config)
    return hf_model.to(dtype=next(nv_model.parameters()).dtype)
