"""The Encodon layer (MAGNETO's "Sub-LN" block, see modeling_codonfm_te.py) built from TE's modules or their torch
twins, its rotary table and its MAGNETO init: what ``NVEncodonModel`` stacks. Both backends build the same parameter
names and state-dict keys; ``backend`` ("te" or "torch", already resolved) chooses.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


try:  # package import (models/codonfm, exported checkpoints)
    from .configuration_codonfm_te import NVEncodonConfig
    from .torch_layers import DotProductAttention as TorchDotProductAttention
    from .torch_layers import LayerNormLinear as TorchLayerNormLinear
    from .torch_layers import apply_rotary_pos_emb as torch_apply_rotary_pos_emb
except ImportError:  # flat copy inside a recipe folder
    from configuration_codonfm_te import NVEncodonConfig
    from torch_layers import DotProductAttention as TorchDotProductAttention
    from torch_layers import LayerNormLinear as TorchLayerNormLinear
    from torch_layers import apply_rotary_pos_emb as torch_apply_rotary_pos_emb

try:
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb as te_apply_rotary_pos_emb
except Exception:  # ImportError, or a broken CUDA install raising at import; the modeling file reports it
    te = te_apply_rotary_pos_emb = None


def apply_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x)  # exact (erf) GELU, the published hidden_act "gelu" and the heads' nn.GELU()


# ---------------------------------------------------------------------------------------------------- MAGNETO init


def magneto_gain(config: NVEncodonConfig) -> float:
    """The published Xavier gain of every linear weight but the query and key projections."""
    return config.initializer_range * math.sqrt(math.log(2 * config.num_hidden_layers))


def magneto_init_(weight: torch.Tensor, role: str, config: NVEncodonConfig) -> None:
    """Draw ``weight`` [out, in] as the published ``nn.Linear`` it stands for: Xavier-normal, std = gain *
    sqrt(2 / (fan_in + fan_out)).

    ``role`` says which: ``"qkv"`` is the fused [query; key; value] projection in TE's interleaved per-head row order,
    drawn block by block as three [hidden, hidden] linears (query and key gain 1, value the scaled gain);
    ``"decoder"`` is the MLM decoder, whose padded vocabulary rows are drawn like the real ones but whose fan-out is
    the real vocabulary (as published); every other role (``"linear"``) uses the weight's own shape.
    """
    if getattr(weight, "_is_hf_initialized", False):  # loaded by from_pretrained: never overwrite
        return
    gain = magneto_gain(config)
    with torch.no_grad():
        if role == "qkv":
            hidden = config.hidden_size
            per_head = weight.view(config.num_attention_heads, 3, config.head_dim, weight.shape[-1])
            query_key_std, value_std = math.sqrt(2 / (2 * hidden)), gain * math.sqrt(2 / (2 * hidden))
            for block, std in ((0, query_key_std), (1, query_key_std), (2, value_std)):
                per_head[:, block].normal_(0.0, std)
            return
        fan_out = config.vocab_size if role == "decoder" else weight.shape[0]
        weight.normal_(0.0, gain * math.sqrt(2 / (weight.shape[1] + fan_out)))


def _magneto_init_method(role: str, config: NVEncodonConfig):
    """``init_method`` for a backend layer: its ``reset_parameters`` then draws what ``_init_weights`` draws."""

    def init_method(weight: torch.Tensor) -> None:
        magneto_init_(weight, role, config)

    return init_method


def tag_magneto_role(module: nn.Module, role: str) -> nn.Module:
    """Mark a linear (or LayerNorm + linear) module with its MAGNETO role, so ``_init_weights`` needs no names."""
    module.magneto_role = role
    return module


# ----------------------------------------------------------------------------------------------------------- layers


class NVEncodonRotaryEmbedding(nn.Module):
    """Rotary angles as TE expects them: [seq, 1, 1, head_dim] float32, half-split (cat(freqs, freqs)) layout."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        # The published formula, term for term, so that a checkpoint's stored inv_freq can be compared with it.
        exponents = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_parameters(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, max_seqlen: int) -> torch.Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # model.to(bfloat16) cast the buffer: recompute rather than round angles
            inv_freq = self._inv_freq(inv_freq.device)
        positions = torch.arange(max_seqlen, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        return torch.cat((freqs, freqs), dim=-1).view(max_seqlen, 1, 1, self.head_dim)


def _layer_kwargs(config: NVEncodonConfig, backend: str) -> dict:
    kwargs = {
        "eps": config.layer_norm_eps,
        "bias": True,
        "normalization": "LayerNorm",
        "params_dtype": config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32,
    }
    if backend == "te":  # TE allocates on CUDA unless told otherwise; honour a meta-device context
        kwargs["device"] = "meta" if torch.empty(0).device.type == "meta" else "cuda"
    return kwargs


class EncodonSelfAttention(nn.Module):
    """``x -> proj(attention(rotary(layernorm_qkv(x))))``: the pre-attention LayerNorm fused into the QKV GEMM, the
    post-attention LayerNorm fused into the output projection."""

    def __init__(self, config: NVEncodonConfig, backend: str, layer_number: int):
        super().__init__()
        hidden = config.hidden_size
        self.backend = backend
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        linear_class = te.LayerNormLinear if backend == "te" else TorchLayerNormLinear
        attention_class = te.DotProductAttention if backend == "te" else TorchDotProductAttention
        kwargs = _layer_kwargs(config, backend)
        self.layernorm_qkv = tag_magneto_role(
            linear_class(hidden, 3 * hidden, init_method=_magneto_init_method("qkv", config), **kwargs), "qkv"
        )
        self.core_attention = attention_class(
            num_attention_heads=self.num_heads,
            kv_channels=self.head_dim,
            attention_dropout=config.attention_probs_dropout_prob,
            qkv_format="thd",
            attn_mask_type="padding",
            layer_number=layer_number,
        )
        self.proj = tag_magneto_role(
            linear_class(hidden, hidden, init_method=_magneto_init_method("linear", config), **kwargs), "linear"
        )

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.backend == "te":
            return te_apply_rotary_pos_emb(t, freqs, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens)
        return torch_apply_rotary_pos_emb(t, freqs, tensor_format="thd", cu_seqlens=cu_seqlens)

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
        # [tokens, 3 * hidden] in TE's interleaved layout: per head its query, key and value rows.
        mixed = self.layernorm_qkv(hidden).view(-1, self.num_heads, 3, self.head_dim)
        query, key, value = mixed.unbind(dim=2)
        query, key = self._rotate(query, rotary, cu_seqlens), self._rotate(key, rotary, cu_seqlens)
        context = self.core_attention(
            query,
            key,
            value,
            qkv_format="thd",
            attn_mask_type="padding",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
        )
        return self.proj(context)


class EncodonMLP(nn.Module):
    """``x -> fc2(act(fc1(x)))``: the pre-FFN LayerNorm fused into ``fc1``, the post-FFN LayerNorm (over the
    intermediate width) into ``fc2``."""

    def __init__(self, config: NVEncodonConfig, backend: str):
        super().__init__()
        linear_class = te.LayerNormLinear if backend == "te" else TorchLayerNormLinear
        kwargs = _layer_kwargs(config, backend)
        init_method = _magneto_init_method("linear", config)
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.fc1 = tag_magneto_role(linear_class(hidden, ffn, init_method=init_method, **kwargs), "linear")
        self.fc2 = tag_magneto_role(linear_class(ffn, hidden, init_method=init_method, **kwargs), "linear")
        self.activation = config.hidden_act

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(apply_activation(self.fc1(hidden), self.activation))


class EncodonLayer(nn.Module):
    """One Encodon layer (the unit FSDP wraps): Sub-LN attention and FFN blocks, each with dropout and a residual."""

    def __init__(self, config: NVEncodonConfig, backend: str, layer_number: int):
        super().__init__()
        self.self_attention = EncodonSelfAttention(config, backend, layer_number)
        self.mlp = EncodonMLP(config, backend)
        self.hidden_dropout = config.hidden_dropout_prob

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
        attention = self.self_attention(hidden, rotary, cu_seqlens, max_seqlen)
        hidden = hidden + F.dropout(attention, self.hidden_dropout, self.training)
        return hidden + F.dropout(self.mlp(hidden), self.hidden_dropout, self.training)
