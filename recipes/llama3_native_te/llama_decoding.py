# Copied from models/llama3/llama3_te/llama_decoding.py — edit the source, then run ci/check_copies.py --fix
"""Cached decoding for the TE-accelerated Llama 3: one ``generate`` step on BSHD input with a Hugging Face key/value
cache, on either backend (``NVLlamaModel.forward_cached`` calls ``cached_decoding_step``).

The layers' fused attention (TE's, or the torch twins' packed one) keeps no cache, so a cached step runs each layer's
own sub-modules (TE's fused RMSNorm+QKV GEMM, output projection and RMSNorm+SwiGLU MLP, or their torch twins: the same
names and weights) around an SDPA attention over the cached keys. Cached steps run in the weights' dtype (FP8 layers
decode in bf16).
"""

import torch
from transformers.cache_utils import Cache


try:  # package import (models/llama3, exported checkpoints)
    from .configuration_llama_te import NVLlamaConfig
    from .fused_residual_layer import FusedResidualTransformerLayer
    from .torch_layers import DotProductAttention as TorchDotProductAttention
    from .torch_layers import apply_rotary_pos_emb
except ImportError:  # flat copy inside a recipe folder
    from configuration_llama_te import NVLlamaConfig
    from fused_residual_layer import FusedResidualTransformerLayer
    from torch_layers import DotProductAttention as TorchDotProductAttention
    from torch_layers import apply_rotary_pos_emb


def module_output(out):
    """Sub-modules of a ``te.TransformerLayer`` return (output, bias) pairs; their torch twins return the output."""
    return out[0] if isinstance(out, tuple) else out


def split_fused_qkv(mixed: torch.Tensor, config: NVLlamaConfig):
    """TE's interleaved fused-QKV output [..., groups * (heads/groups + 2) * head_dim] -> q, k, v [..., heads, dim]."""
    groups, per_group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    lead = mixed.shape[:-1]
    q, k, v = mixed.view(*lead, groups, per_group + 2, config.head_dim).split([per_group, 1, 1], dim=-2)
    return (x.reshape(*lead, -1, config.head_dim) for x in (q, k, v))


def _cached_layer_step(
    layer, layer_index: int, config: NVLlamaConfig, hidden, rotary, positions, cache: Cache, attend
) -> torch.Tensor:
    """One pre-norm decoder block on BSHD ``hidden`` [batch, new, hidden] with a key/value cache.

    Runs the layer's own sub-modules (TE's or the torch twins', same names and weights) and ``attend`` (causal
    attention over all cached keys) in place of the layer's fused attention, which has no Hugging Face cache.
    """
    attention = layer.self_attention
    q, k, v = split_fused_qkv(module_output(attention.layernorm_qkv(hidden)), config)
    q = apply_rotary_pos_emb(q, rotary, "bshd", positions=positions)
    k = apply_rotary_pos_emb(k, rotary, "bshd", positions=positions)
    # Hugging Face caches hold [batch, heads, seq, head_dim]; the layers work in [batch, seq, heads, head_dim].
    keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer_index)
    context = attend(q, keys.transpose(1, 2), values.transpose(1, 2))
    attention_out = module_output(attention.proj(context))
    if isinstance(layer, FusedResidualTransformerLayer):  # its MLP adds the residual itself: (mlp_out, hidden + a)
        mlp_out, hidden = layer.layernorm_mlp(attention_out, hidden)
        return hidden + mlp_out
    hidden = hidden + attention_out
    return hidden + module_output(layer.layernorm_mlp(hidden))


def cached_decoding_step(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: Cache,
) -> torch.Tensor:
    """One decoding step of ``model`` (an ``NVLlamaModel``) on BSHD input with a key/value cache (either backend):
    returns [batch, new, hidden].

    ``attention_mask`` covers cached and new tokens ([batch, past + new]), as ``generate`` passes it.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"cached decoding takes BSHD input_ids [batch, seq], got {tuple(input_ids.shape)}")
    batch, new = input_ids.shape
    past = past_key_values.get_seq_length()
    if attention_mask is None:
        attention_mask = torch.ones(batch, past + new, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape != (batch, past + new):
        raise ValueError(
            f"attention_mask must cover the {past} cached and {new} new tokens: expected {(batch, past + new)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]
    position_ids = position_ids.expand(batch, new)
    rotary = model.rotary_emb(int(position_ids.max()) + 1)
    ignore_key = ~attention_mask.bool()[:, None, None, :]  # TE convention: True where a key is masked
    # Causal attention of the new queries over all cached keys (aligned to the last key), GQA, padding masked;
    # the twin's SDPA-based attention has no weights, so it serves both backends.
    core = TorchDotProductAttention(
        model.config.num_attention_heads,
        model.config.head_dim,
        num_gqa_groups=model.config.num_key_value_heads,
        attn_mask_type="padding_causal",
    )

    def attend(q, k, v):
        return core(q, k, v, attention_mask=ignore_key, qkv_format="bshd")

    if model.qkv_rotary is not None:  # these steps rotate with the cache's positions, not in the projection
        model.qkv_rotary.set_batch(None)
    hidden = model.embed_tokens(input_ids)
    for index, layer in enumerate(model.layers):
        hidden = _cached_layer_step(layer, index, model.config, hidden, rotary, position_ids, past_key_values, attend)
    return model.norm(hidden)
