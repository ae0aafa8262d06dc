"""Convert between Hugging Face ``LlamaForCausalLM`` and ``NVLlamaForCausalLM``; a round trip is exact.

The two differ in three places: TE fuses Q, K and V into one interleaved weight (per key/value group: the
group's query heads, then its key head, then its value head), fuses the SwiGLU gate and up projections into
``fc1`` (gate first: TE applies SiLU to the first half), and names the RMSNorms after the layers they feed. The
vocabulary (embedding and LM-head rows) is padded to ``padded_vocab_size``. Everything else maps one to one.
"""

import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM


# Hugging Face key suffix inside `model.layers.{i}.` -> NVLlama key suffix inside the same prefix
_LAYER_KEY_MAP = {
    "input_layernorm.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": "self_attention.proj.weight",
    "post_attention_layernorm.weight": "layernorm_mlp.layer_norm_weight",
    "mlp.down_proj.weight": "layernorm_mlp.fc2_weight",
}
_FUSED_QKV = "self_attention.layernorm_qkv.weight"
_FUSED_FC1 = "layernorm_mlp.fc1_weight"
_NV_ONLY_CONFIG_KEYS = ("backend", "padded_vocab_size", "layer_precision", "auto_map", "architectures", "model_type")


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[heads * d, hidden], [groups * d, hidden] x2 -> [groups * (heads/groups + 2) * d, hidden] in TE's order."""
    hidden = q.shape[-1]
    q = q.reshape(num_groups, -1, hidden)  # [groups, heads/groups * d, hidden]
    k = k.reshape(num_groups, -1, hidden)
    v = v.reshape(num_groups, -1, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    hidden = fused.shape[-1]
    per_group = fused.reshape(num_groups, num_heads // num_groups + 2, head_dim, hidden)
    q, k, v = per_group.split([num_heads // num_groups, 1, 1], dim=1)
    return tuple(t.reshape(-1, hidden) for t in (q, k, v))


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    padded = tensor.new_zeros(rows, *tensor.shape[1:])
    padded[: tensor.shape[0]] = tensor
    return padded


def _load_exactly(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model``; every key must exist with the same shape, and every weight must be given.

    TE's ``_extra_state`` (FP8 bookkeeping) keeps the model's own value when the source has none.
    """
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state and not k.endswith("_extra_state"))
    unexpected = sorted(k for k in state if k not in expected)
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state.items()
        if k in expected and not k.endswith("_extra_state") and v.shape != expected[k].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"cannot load {source}: "
            + "; ".join(
                f"{label} ({len(keys)}): {keys[:5]}{' ...' if len(keys) > 5 else ''}"
                for label, keys in (
                    ("missing keys", missing),
                    ("unexpected keys", unexpected),
                    ("shape mismatch", mismatched),
                )
                if keys
            )
        )
    model.load_state_dict({**expected, **state}, strict=True)


def nv_config_from_hf(hf_config: LlamaConfig, **overrides) -> NVLlamaConfig:
    values = {k: v for k, v in hf_config.to_dict().items() if k not in ("model_type", "architectures", "auto_map")}
    values.update(overrides)
    return NVLlamaConfig(**values)


def hf_config_from_nv(nv_config: NVLlamaConfig) -> LlamaConfig:
    values = {k: v for k, v in nv_config.to_dict().items() if k not in _NV_ONLY_CONFIG_KEYS}
    return LlamaConfig(**values)


def convert_llama_hf_to_te(hf_model: LlamaForCausalLM, **config_overrides) -> NVLlamaForCausalLM:
    """Build an ``NVLlamaForCausalLM`` holding ``hf_model``'s weights; ``config_overrides`` set e.g. ``backend``."""
    config = nv_config_from_hf(hf_model.config, **config_overrides)
    hf_state = hf_model.state_dict()
    groups = config.num_key_value_heads
    state = {
        "model.norm.weight": hf_state["model.norm.weight"],
        "model.embed_tokens.weight": _pad_rows(hf_state["model.embed_tokens.weight"], config.padded_vocab_size),
    }
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    else:
        state["lm_head.weight"] = _pad_rows(hf_state["lm_head.weight"], config.padded_vocab_size)
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
    _load_exactly(nv_model, state, "Hugging Face Llama weights")
    if config.tie_word_embeddings:
        nv_model.tie_weights()
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
            parts = split_qkv(value, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
            for name, part in zip("qkv", parts):
                state[f"{prefix}self_attn.{name}_proj.weight"] = part
        elif suffix == _FUSED_FC1:
            gate, up = value.chunk(2, dim=0)
            state[f"{prefix}mlp.gate_proj.weight"], state[f"{prefix}mlp.up_proj.weight"] = gate, up
        else:
            raise ValueError(f"NVLlama checkpoint key {key!r} has no Hugging Face counterpart")

    hf_model = LlamaForCausalLM(hf_config_from_nv(config))
    _load_exactly(hf_model, state, "NVLlama weights")
    if config.tie_word_embeddings:
        hf_model.tie_weights()
    return hf_model.to(dtype=next(nv_model.parameters()).dtype)
