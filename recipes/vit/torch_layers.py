# Copied from common/torch_layers.py — edit the source, then run ci/check_copies.py --fix
"""The torch backend: pure-PyTorch twins of the TransformerEngine layers this project uses.

Each class has the constructor arguments (the subset we use), parameter names, state-dict keys and numerics of its
``transformer_engine.pytorch`` namesake, so a checkpoint written with one backend loads into the other and the same
modeling code runs on a laptop CPU or on a GPU with TE. Modeling code imports them from here; they live in three
files, each with one job:

* torch_norm_linear.py: ``LayerNorm``, ``RMSNorm``, ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``;
* torch_attention.py: ``apply_rotary_pos_emb``, ``context_parallel_positions``, ``DotProductAttention`` (``bshd`` and
  ``thd``, context parallelism) and ``MultiheadAttention``;
* this file: ``TransformerLayer``, built from the two.

Differences that are inherent: no FP8/FP4 (those need TE), so ``_extra_state`` (TE's FP8 bookkeeping) is kept as an
opaque pass-through that keeps state-dict keys equal in both directions; ``"gelu"`` is the exact erf form (TE's kernel
is the tanh approximation, ``"gelu_tanh"`` here).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


try:  # package import (models/*, exported checkpoints)
    from .torch_attention import (
        DotProductAttention,
        MultiheadAttention,
        apply_rotary_pos_emb,
        context_parallel_positions,
    )
    from .torch_norm_linear import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
except ImportError:  # flat copy inside a recipe folder
    from torch_attention import (
        DotProductAttention,
        MultiheadAttention,
        apply_rotary_pos_emb,
        context_parallel_positions,
    )
    from torch_norm_linear import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm

__all__ = [
    "DotProductAttention",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "TransformerLayer",
    "apply_rotary_pos_emb",
    "context_parallel_positions",
    "is_torch_twin",
]


class TransformerLayer(nn.Module):
    """``te.TransformerLayer`` (``layer_type="encoder"``). By default pre-norm:

    ``x = x + dropout(self_attention(x)); x = x + dropout(layernorm_mlp(x))``.

    ``output_layernorm=True`` moves the attention's norm to the layer's output (``layernorm``), and
    ``apply_residual_connection_post_layernorm=True`` takes the residuals from the norms' outputs, as TE does. The
    two together are BERT's post-norm layer: ``h = LN_1(x + dropout(attn(x))); out = LN_2(h + dropout(mlp(h)))``,
    with ``LN_1`` the ``layernorm_mlp``'s norm and ``LN_2`` the output ``layernorm``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        params_dtype=None,
        qkv_weight_interleaved: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        device=None,
        attn_input_format: str = "sbhd",
        layer_number: int | None = None,
        output_layernorm: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        **unused,
    ):
        super().__init__()
        if attn_input_format not in ("bshd", "thd"):
            raise ValueError(
                f"the torch backend supports attn_input_format 'bshd' and 'thd', not {attn_input_format!r}"
            )
        common = {"params_dtype": params_dtype, "device": device, "bias": bias, "normalization": normalization}
        self.hidden_dropout = hidden_dropout
        self.output_layernorm = output_layernorm
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.self_attention = MultiheadAttention(
            hidden_size,
            num_attention_heads,
            kv_channels=kv_channels,
            num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout,
            layernorm_epsilon=layernorm_epsilon,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            attn_mask_type=self_attn_mask_type,
            qkv_weight_interleaved=qkv_weight_interleaved,
            qkv_format=attn_input_format,
            layer_number=layer_number,
            input_layernorm=not output_layernorm,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            **common,
        )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            activation=activation,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            **common,
        )
        if output_layernorm:
            norm_class = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
            self.layernorm = norm_class(hidden_size, eps=layernorm_epsilon, params_dtype=params_dtype, device=device)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p") -> None:
        """As ``te.TransformerLayer``: split the self-attention of ``thd`` batches over ``cp_group``."""
        self.self_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

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
        **_,
    ) -> torch.Tensor:
        attention_out = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
        )
        residual = hidden_states
        if self.self_attention.return_layernorm_output:  # pre-norm with the residual from the norm's output
            attention_out, residual = attention_out
        hidden_states = residual + F.dropout(attention_out, self.hidden_dropout, self.training)
        mlp_out, residual = self.layernorm_mlp(hidden_states), hidden_states
        if self.apply_residual_connection_post_layernorm:
            mlp_out, residual = mlp_out
        output = residual + F.dropout(mlp_out, self.hidden_dropout, self.training)
        return self.layernorm(output) if self.output_layernorm else output


# The modules the twins are defined in (this file and its two parts), for callers that tell twins from other modules.
_TWIN_MODULES = frozenset(cls.__module__ for cls in (TransformerLayer, DotProductAttention, LayerNorm))


def is_torch_twin(module: nn.Module) -> bool:
    """Whether ``module`` is one of this backend's twins of a TE module (any of the three files)."""
    return type(module).__module__ in _TWIN_MODULES
