"""A pre-norm RMSNorm + SwiGLU encoder layer for packed (THD) input whose residual adds live in the norm kernels.

``FusedResidualTransformerLayer`` computes what ``te.TransformerLayer(normalization="RMSNorm", activation="swiglu",
bias=False, attn_input_format="thd", qkv_weight_interleaved=True)`` computes (AMPLIFY's layer), with the same
parameter names and state-dict keys, so that a model can switch between the two and checkpoints load either way:

    self_attention.layernorm_qkv.{layer_norm_weight, weight}, self_attention.proj.weight,
    layernorm_mlp.{layer_norm_weight, fc1_weight, fc2_weight}  (and TE's ``_extra_state`` keys)

What differs is how the work is split into kernels (residual_rmsnorm.py): TE's layer spends a separate elementwise
kernel on each residual add in the forward and on each sum of two gradients in the backward (four per layer, each a
full pass over [tokens, hidden]). Here the attention's residual add is done by the FFN norm's kernel (which writes the
sum and its normalised form in one pass) and both backward sums by the norms' backward kernels; the layer's last add
is left to the next layer's first norm kernel when the caller chains layers with ``defer_residual`` (see
``forward``), else it is a separate kernel. The GEMMs are torch's (cuBLAS, as TE's are in bf16),
attention is TE's fused attention on query/key/value views of the QKV projection (te_attention.py), and SwiGLU is
TE's kernel. Rotary embeddings must be applied inside the QKV projection (packed_rope.py's forward hook on
``self_attention.layernorm_qkv``, which this layer's projection returns as ``(qkv, residual)``).

Only bf16/fp32 compute: no FP8 or FP4 (those need TE's modules), no dropout, no context parallelism. The model that
offers this layer (AMPLIFY's ``fused_residual_norm``) refuses those combinations before building it.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


try:  # package import (models/amplify, exported checkpoints)
    from .residual_rmsnorm import add_rms_norm, rms_norm_keep_input
    from .te_attention import SplitPackedQKV
    from .torch_layers import LayerNormLinear, LayerNormMLP, Linear
except ImportError:  # flat copy inside a recipe folder
    from residual_rmsnorm import add_rms_norm, rms_norm_keep_input
    from te_attention import SplitPackedQKV
    from torch_layers import LayerNormLinear, LayerNormMLP, Linear

try:
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
except Exception:  # ImportError, or a broken CUDA install raising at import; the layer refuses to build then
    te = tex = None


class _SwiGLU(torch.autograd.Function):
    """TE's SwiGLU kernels (``silu(first half) * second half``, as ``te.LayerNormMLP`` runs them)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return tex.swiglu(x, None)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return tex.dswiglu(grad.contiguous(), x, None)


class RMSNormQKV(LayerNormLinear):
    """``layernorm_qkv``: RMSNorm, then the fused QKV projection. Returns ``(qkv, residual)``.

    ``residual`` is what the layer's residual path adds to attention's output: the input itself, handed back through
    the norm so that its gradient joins the norm's in one backward kernel, or, given ``pending`` (the previous layer's
    last residual, not yet added), the sum ``x + pending``, formed by the norm's kernel.
    """

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None = None):
        if pending is None:
            normed, residual = rms_norm_keep_input(x, self.layer_norm_weight, self.eps)
        else:
            normed, residual = add_rms_norm(x, pending, self.layer_norm_weight, self.eps)
        return F.linear(normed, self.weight), residual


class AddRMSNormMLP(LayerNormMLP):
    """``layernorm_mlp``: ``h = attention_out + residual``, RMSNorm, fc1, SwiGLU, fc2. Returns ``(mlp_out, h)``."""

    def forward(self, attention_out: torch.Tensor, residual: torch.Tensor):
        normed, total = add_rms_norm(attention_out, residual, self.layer_norm_weight, self.eps)
        hidden = _SwiGLU.apply(F.linear(normed, self.fc1_weight))
        return F.linear(hidden, self.fc2_weight), total


class _SelfAttention(nn.Module):
    """``self_attention``: ``layernorm_qkv`` -> TE's ``core_attention`` -> ``proj`` (TE's module names)."""

    def __init__(self, hidden_size, num_heads, head_dim, eps, init_method, output_layer_init_method, layer_number, kw):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        qkv_size = 3 * num_heads * head_dim
        self.layernorm_qkv = RMSNormQKV(
            hidden_size, qkv_size, eps=eps, normalization="RMSNorm", init_method=init_method, **kw
        )
        self.core_attention = te.DotProductAttention(
            num_heads,
            head_dim,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding",
            layer_number=layer_number,
        )
        self.proj = Linear(num_heads * head_dim, hidden_size, init_method=output_layer_init_method, **kw)


class FusedResidualTransformerLayer(nn.Module):
    """See the module docstring. Takes ``te.TransformerLayer``'s constructor and forward arguments (those that
    AMPLIFY's layer uses) and refuses settings it does not implement."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        self_attn_mask_type: str = "padding",
        normalization: str = "RMSNorm",
        activation: str = "swiglu",
        bias: bool = False,
        qkv_weight_interleaved: bool = True,
        attn_input_format: str = "thd",
        params_dtype=None,
        device=None,
        **unused,
    ):
        super().__init__()
        if te is None:
            raise RuntimeError("FusedResidualTransformerLayer needs TransformerEngine (its attention and SwiGLU)")
        settings = {
            "normalization": (normalization, "RMSNorm"),
            "activation": (activation, "swiglu"),
            "bias": (bias, False),
            "qkv_weight_interleaved": (qkv_weight_interleaved, True),
            "attn_input_format": (attn_input_format, "thd"),
            "self_attn_mask_type": (self_attn_mask_type, "padding"),
            "hidden_dropout": (hidden_dropout, 0.0),
            "attention_dropout": (attention_dropout, 0.0),
        }
        unsupported = [
            f"{name}={value!r} (needs {needed!r})" for name, (value, needed) in settings.items() if value != needed
        ]
        if unsupported:
            raise ValueError("FusedResidualTransformerLayer does not support " + ", ".join(unsupported))
        head_dim = kv_channels or hidden_size // num_attention_heads
        kw = {"params_dtype": params_dtype, "device": device, "bias": False}
        self.self_attention = _SelfAttention(
            hidden_size,
            num_attention_heads,
            head_dim,
            layernorm_epsilon,
            init_method,
            output_layer_init_method,
            layer_number,
            kw,
        )
        self.layernorm_mlp = AddRMSNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            normalization="RMSNorm",
            activation="swiglu",
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            **kw,
        )

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p") -> None:
        if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
            raise ValueError("FusedResidualTransformerLayer does not support context parallelism; use TE's layer")

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        pending_residual: torch.Tensor | None = None,
        defer_residual: bool = False,
        **unused,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """TE's layer's forward, plus a way to leave the last residual add to the next layer's first norm kernel.

        The layer's output is ``mlp_out + h`` (``h`` = the input plus attention's output). With ``defer_residual``
        it returns ``(mlp_out, h)`` unsummed, and the next layer, called with ``hidden_states=mlp_out,
        pending_residual=h``, adds them inside its first norm (one pass over [tokens, hidden] less per layer). Whoever
        receives the pair from the last layer adds it.
        """
        if rotary_pos_emb is not None:
            raise ValueError(
                "FusedResidualTransformerLayer applies no rotary table itself: rotate inside the QKV projection "
                "(packed_rope.PackedQKVRotary) and call it with rotary_pos_emb=None"
            )
        if cu_seqlens_q is None or max_seqlen_q is None:
            raise ValueError(
                "FusedResidualTransformerLayer takes packed (THD) input: pass cu_seqlens_q and max_seqlen_q"
            )
        if torch.is_autocast_enabled(hidden_states.device.type):  # as TE's layer: activations in the autocast dtype
            dtype = torch.get_autocast_dtype(hidden_states.device.type)
            hidden_states = hidden_states.to(dtype)
            pending_residual = pending_residual.to(dtype) if pending_residual is not None else None
        attention = self.self_attention
        qkv, residual = attention.layernorm_qkv(hidden_states, pending_residual)
        tokens = qkv.shape[0]
        query, key, value = SplitPackedQKV.apply(qkv.view(tokens, attention.num_heads, 3, attention.head_dim), -2)
        context = attention.core_attention(
            query,
            key,
            value,
            qkv_format="thd",
            attn_mask_type="padding",
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_q_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv if max_seqlen_kv is not None else max_seqlen_q,
        )
        mlp_out, total = self.layernorm_mlp(attention.proj(context), residual)
        return (mlp_out, total) if defer_residual else total + mlp_out
