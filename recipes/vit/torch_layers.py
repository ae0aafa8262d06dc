# Copied from common/torch_layers.py — edit the source, then run ci/check_copies.py --fix
"""Pure-PyTorch twins of the TransformerEngine layers this project uses.

Each class here has the constructor arguments (the subset we use), parameter names, state-dict keys and
numerics of its ``transformer_engine.pytorch`` namesake, so a checkpoint written with one backend loads into
the other and the same modeling code runs on a laptop CPU or on a GPU with TE. Differences that are inherent:

* TE's ``"gelu"`` kernel is the tanh approximation; here ``"gelu"`` is the exact erf form that ESM and Hugging
  Face use (the difference, < 5e-4 per activation, is below bf16 resolution). ``"gelu_tanh"`` is TE's form.
* No FP8/FP4: those need TE. ``_extra_state`` (TE's FP8 bookkeeping) is kept as an opaque pass-through so that
  state-dict keys match in both directions.

Attention accepts TE's ``bshd`` layout (``[batch, seq, hidden]`` plus a padding mask) and ``thd`` layout
(``[tokens, hidden]`` plus ``cu_seqlens``), with the same masking: no token attends across a sequence boundary
or to padding. With more keys than queries (decoding against a cache), the causal mask aligns to the last key.

Context parallelism (``set_context_parallel_group``, ``thd`` only), with TE's data layout: each rank holds chunks
``r`` and ``2 * cp_size - 1 - r`` of every sequence padded to a multiple of ``2 * cp_size``, ``cu_seqlens_*_padded``
are the global padded boundaries and rotary positions are the tokens' global positions. Where TE passes K/V blocks
around a ring, this twin all-gathers Q/K/V, attends over the whole batch and keeps its own rows: the same numbers at
``cp_size`` times the attention cost, which is fine for what it is for (CPU tests of context-parallel training).
"""

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
]


def _default_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=0.023)  # TE's default init_method


class _ExtraStateMixin:
    """Mirror TE's ``_extra_state`` key: keep whatever was loaded and hand it back unchanged on save."""

    _opaque_extra_state: torch.Tensor | None = None

    def get_extra_state(self) -> torch.Tensor:
        if self._opaque_extra_state is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._opaque_extra_state

    def set_extra_state(self, state) -> None:
        self._opaque_extra_state = state if isinstance(state, torch.Tensor) and state.numel() > 0 else None


def _normalize(
    x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if normalization == "RMSNorm":
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
        return normed.to(x.dtype) * weight
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    if activation == "silu":
        return F.silu(x)
    if activation == "swiglu":  # TE gates with the first half: silu(a) * b
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b
    if activation == "geglu":
        a, b = x.chunk(2, dim=-1)
        return F.gelu(a) * b
    raise ValueError(f"unsupported activation {activation!r}")


class LayerNorm(_ExtraStateMixin, nn.Module):
    """``te.LayerNorm``: parameters ``weight`` and ``bias`` (and, as TE's fusible operations have, ``_extra_state``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype=None, device=None, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(_ExtraStateMixin, nn.Module):
    """``te.RMSNorm``: parameter ``weight`` (and ``_extra_state``, as ``te.LayerNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype=None, device=None, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(x, "RMSNorm", self.weight, None, self.eps)


class Linear(_ExtraStateMixin, nn.Module):
    """``te.Linear``: parameters ``weight`` [out, in] and ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Callable | None = None,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.init_method = init_method or _default_init
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=params_dtype, device=device)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_method(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNormLinear(_ExtraStateMixin, nn.Module):
    """``te.LayerNormLinear``: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``weight``, ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        init_method: Callable | None = None,
        return_layernorm_output: bool = False,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.eps = eps
        self.normalization = normalization
        self.init_method = init_method or _default_init
        self.return_layernorm_output = return_layernorm_output
        kwargs = {"dtype": params_dtype, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features, **kwargs))
        self.layer_norm_bias = (
            nn.Parameter(torch.empty(in_features, **kwargs)) if normalization == "LayerNorm" else None
        )
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kwargs))
        self.bias = nn.Parameter(torch.empty(out_features, **kwargs)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        self.init_method(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor):
        """The output, or ``(output, normalised input)`` with ``return_layernorm_output`` (as TE)."""
        normed = _normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        out = F.linear(normed, self.weight, self.bias)
        return (out, normed) if self.return_layernorm_output else out


class LayerNormMLP(_ExtraStateMixin, nn.Module):
    """``te.LayerNormMLP``: norm, ``fc1`` (doubled width for gated activations), activation, ``fc2``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        return_layernorm_output: bool = False,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.eps = eps
        self.normalization = normalization
        self.activation = activation
        self.return_layernorm_output = return_layernorm_output
        self.init_method = init_method or _default_init
        self.output_layer_init_method = output_layer_init_method or _default_init
        fc1_out = 2 * ffn_hidden_size if activation in ("swiglu", "geglu") else ffn_hidden_size
        kwargs = {"dtype": params_dtype, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, **kwargs))
        self.layer_norm_bias = (
            nn.Parameter(torch.empty(hidden_size, **kwargs)) if normalization == "LayerNorm" else None
        )
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **kwargs))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **kwargs)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **kwargs))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **kwargs)) if bias else None
        if self.fc1_weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        self.init_method(self.fc1_weight)
        self.output_layer_init_method(self.fc2_weight)
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x: torch.Tensor):
        """The output, or ``(output, normalised input)`` with ``return_layernorm_output`` (as TE)."""
        normed = _normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        hidden = _activation(F.linear(normed, self.fc1_weight, self.fc1_bias), self.activation)
        out = F.linear(hidden, self.fc2_weight, self.fc2_bias)
        return (out, normed) if self.return_layernorm_output else out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _positions_in_sequence(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Index of each packed token within its own sequence, e.g. cu_seqlens [0, 3, 5] -> [0, 1, 2, 0, 1]."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total_tokens)
    return torch.arange(total_tokens, device=cu_seqlens.device) - starts


def context_parallel_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Position within its sequence of each token CP rank ``cp_rank`` holds (TE's load-balanced split).

    Every sequence is padded to a multiple of ``2 * cp_size`` and cut into ``2 * cp_size`` chunks; rank r holds
    chunks r and 2 * cp_size - 1 - r, so causal attention costs every rank the same. E.g. one sequence of 8,
    cp_size 2: rank 0 holds positions [0, 1, 6, 7], rank 1 holds [2, 3, 4, 5].
    """
    local_cu = torch.div(cu_seqlens_padded, cp_size, rounding_mode="floor")
    total_local = int(local_cu[-1])
    local_position = _positions_in_sequence(local_cu, total_local)
    chunk = torch.div(local_cu[1:] - local_cu[:-1], 2, rounding_mode="floor")
    chunk_of_token = torch.repeat_interleave(chunk, local_cu[1:] - local_cu[:-1], output_size=total_local)
    in_first_chunk = local_position < chunk_of_token
    return torch.where(
        in_first_chunk,
        cp_rank * chunk_of_token + local_position,
        (2 * cp_size - 2 - cp_rank) * chunk_of_token + local_position,  # (2cp-1-r) * chunk + (position - chunk)
    )


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "bshd",
    cu_seqlens: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """TE's non-interleaved rotary embedding, computed in float32.

    ``freqs`` is [max_seq_len, 1, 1, head_dim] (as ``te.RotaryPositionEmbedding`` returns it). For ``thd``,
    positions restart at 0 at every sequence boundary given by ``cu_seqlens``; with ``cp_size > 1`` (as in TE)
    ``cu_seqlens`` are the global padded boundaries and ``t`` holds rank ``cp_rank``'s share. Explicit
    ``positions`` (the leading dimensions of ``t``: [batch, seq] or [tokens]) override these rules, e.g. for
    cached decoding.
    """
    if positions is not None:
        angles = freqs.reshape(freqs.shape[0], -1)[positions].unsqueeze(-2)  # [..., 1, head_dim]
    elif tensor_format == "thd":
        if cp_size > 1:
            positions = context_parallel_positions(cu_seqlens, cp_size, cp_rank)
        else:
            positions = _positions_in_sequence(cu_seqlens, t.shape[0])
        angles = freqs[positions]  # [t, 1, 1, d] -> broadcast over heads below
        angles = angles.view(t.shape[0], 1, -1)
    elif tensor_format == "bshd":
        angles = freqs[: t.shape[1]].view(1, t.shape[1], 1, -1)
    else:
        raise ValueError(f"tensor_format must be 'bshd' or 'thd', got {tensor_format!r}")
    t_float = t.float()
    rotated = t_float * angles.cos() + _rotate_half(t_float) * angles.sin()
    return rotated.to(t.dtype)


class _AllGatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (equal shares), backward: the sum over ranks of the gradient of this rank's share.

    An all-reduce plus a slice instead of a reduce-scatter, so that it also runs on gloo (CPU tests).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        shares = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shares, x.contiguous(), group=group)
        return torch.cat(shares)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        share = grad.shape[0] // dist.get_world_size(ctx.group)
        start = dist.get_rank(ctx.group) * share
        return grad[start : start + share], None


class DotProductAttention(_ExtraStateMixin, nn.Module):
    """``te.DotProductAttention`` on ``torch.nn.functional.scaled_dot_product_attention``.

    ``thd`` input is scattered into a padded [sequences, max_len] batch for SDPA and gathered back, so no token
    sees another sequence. Query head ``h`` uses key/value head ``h // (heads / gqa_groups)``, as in TE.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "bshd",
        attn_mask_type: str = "padding",
        softmax_scale: float | None = None,
        **_,
    ):
        super().__init__()
        self.num_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.head_dim = kv_channels
        self.dropout = attention_dropout
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.cp_group = None

    @property
    def causal(self) -> bool:
        return "causal" in self.attn_mask_type

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p") -> None:
        """Split ``thd`` attention over ``cp_group`` (see the module docstring); the stream and ranks are TE's."""
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        **_,
    ) -> torch.Tensor:
        if (qkv_format or self.qkv_format) == "thd":
            if self.cp_group is not None:
                return self._forward_thd_context_parallel(
                    query, key, value, cu_seqlens_q, cu_seqlens_q_padded, max_seqlen_q
                )
            return self._forward_thd(query, key, value, cu_seqlens_q, max_seqlen_q)
        if self.cp_group is not None:
            raise ValueError("context-parallel attention takes thd input only")
        # bshd: [b, s, h, d]; TE's padding mask is True where a key must be ignored, shape [b, 1, 1, s].
        out = self._sdpa(query, key, value, keep_mask=None if attention_mask is None else ~attention_mask)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _sdpa(self, q, k, v, keep_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # -> [b, h, s, d]
        if self.causal:
            s_q, s_k = q.shape[2], k.shape[2]
            causal = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(diagonal=s_k - s_q)
            if keep_mask is None:
                keep_mask = causal
            else:
                # A query at a padding position (left padding) would see no key at all, and SDPA turns such a
                # row into NaN, which later layers would spread through the padding keys. Let every query see
                # its own key: this changes nothing for real tokens and keeps padding rows finite.
                own_key = torch.zeros_like(causal)
                own_key.diagonal(s_k - s_q).fill_(True)
                keep_mask = (keep_mask & causal) | own_key
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep_mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=self.num_gqa_groups != self.num_heads,
        )
        return out.transpose(1, 2)

    def _forward_thd(
        self, q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int | None, key_lengths=None
    ) -> torch.Tensor:
        """``key_lengths`` (default: the segment lengths) hides each segment's trailing keys, e.g. CP padding."""
        if cu_seqlens is None:
            raise ValueError("thd attention needs cu_seqlens_q")
        total = q.shape[0]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_len = int(max_seqlen) if max_seqlen is not None else int(lengths.max())
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths, output_size=total)
        slot = seq_ids * max_len + _positions_in_sequence(cu_seqlens, total)

        def to_padded(x: torch.Tensor) -> torch.Tensor:
            padded = x.new_zeros(len(lengths) * max_len, *x.shape[1:])
            padded[slot] = x
            return padded.view(len(lengths), max_len, *x.shape[1:])

        key_lengths = lengths if key_lengths is None else key_lengths
        keep = torch.arange(max_len, device=q.device)[None, :] < key_lengths[:, None]  # [n, max_len]
        out = self._sdpa(to_padded(q), to_padded(k), to_padded(v), keep_mask=keep[:, None, None, :])
        return out.reshape(len(lengths) * max_len, -1)[slot]

    def _forward_thd_context_parallel(self, q, k, v, cu_seqlens, cu_seqlens_padded, max_seqlen) -> torch.Tensor:
        if cu_seqlens is None or cu_seqlens_padded is None:
            raise ValueError("context-parallel thd attention needs cu_seqlens_q and cu_seqlens_q_padded")
        cp_size, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        starts = cu_seqlens_padded[:-1]
        local_lengths = torch.div(cu_seqlens_padded[1:] - starts, cp_size, rounding_mode="floor")
        start_of_token = torch.repeat_interleave(starts, local_lengths, output_size=q.shape[0])

        def global_rows(rank: int) -> torch.Tensor:
            return start_of_token + context_parallel_positions(cu_seqlens_padded, cp_size, rank)

        # One all-gather for Q, K and V; rows come back rank by rank and are put in global order.
        widths = [x.shape[1] for x in (q, k, v)]
        local = torch.cat([q, k, v], dim=1)
        gathered = _AllGatherTokens.apply(local, self.cp_group)
        order = torch.argsort(torch.cat([global_rows(rank) for rank in range(cp_size)]))
        full_q, full_k, full_v = gathered[order].split(widths, dim=1)
        out = self._forward_thd(
            full_q, full_k, full_v, cu_seqlens_padded, max_seqlen, key_lengths=cu_seqlens[1:] - cu_seqlens[:-1]
        )
        return out[global_rows(cp_rank)]


class MultiheadAttention(nn.Module):
    """``te.MultiheadAttention`` (self-attention, fused QKV): ``layernorm_qkv`` (with ``input_layernorm``, the way
    ``te.TransformerLayer`` builds it for pre-norm layers) or ``qkv`` (without: post-norm layers), then
    ``core_attention`` and ``proj``. The fused QKV weight follows TE's layouts: interleaved is
    [groups, (heads/groups + 2), head_dim] rows, otherwise [(heads/groups + 2), groups, head_dim].

    Unlike a standalone ``te.MultiheadAttention``, ``input_layernorm`` defaults to True: this twin is built by the
    twin ``TransformerLayer``, which passes ``input_layernorm=not output_layernorm`` as TE's does.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        attn_mask_type: str = "padding",
        qkv_weight_interleaved: bool = True,
        normalization: str = "LayerNorm",
        bias: bool = True,
        qkv_format: str = "bshd",
        layer_number: int | None = None,
        input_layernorm: bool = True,
        return_layernorm_output: bool = False,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = input_layernorm
        self.return_layernorm_output = return_layernorm_output and input_layernorm
        self.num_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.head_dim = kv_channels or hidden_size // num_attention_heads
        self.qkv_weight_interleaved = qkv_weight_interleaved
        self.qkv_format = qkv_format
        common = {"params_dtype": params_dtype, "device": device, "bias": bias}
        qkv_size = (self.num_heads + 2 * self.num_gqa_groups) * self.head_dim
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size,
                qkv_size,
                eps=layernorm_epsilon,
                normalization=normalization,
                init_method=init_method,
                return_layernorm_output=self.return_layernorm_output,
                **common,
            )
        else:
            self.qkv = Linear(hidden_size, qkv_size, init_method=init_method, **common)
        self.core_attention = DotProductAttention(
            num_attention_heads,
            self.head_dim,
            num_gqa_groups=self.num_gqa_groups,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
        )
        self.proj = Linear(self.num_heads * self.head_dim, hidden_size, init_method=output_layer_init_method, **common)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p") -> None:
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _split_qkv(self, mixed: torch.Tensor):
        per_group = self.num_heads // self.num_gqa_groups
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            mixed = mixed.view(*lead, self.num_gqa_groups, per_group + 2, self.head_dim)
            q, k, v = mixed.split([per_group, 1, 1], dim=-2)
        else:
            mixed = mixed.view(*lead, per_group + 2, self.num_gqa_groups, self.head_dim)
            q, k, v = mixed.split([per_group, 1, 1], dim=-3)
        return (x.reshape(*lead, -1, self.head_dim) for x in (q, k, v))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        **_,
    ):
        """The attention output, or ``(output, normalised input)`` with ``return_layernorm_output`` (as TE)."""
        if self.input_layernorm:
            mixed = self.layernorm_qkv(hidden_states)
            if self.return_layernorm_output:
                mixed, normed = mixed
        else:
            mixed = self.qkv(hidden_states)
        q, k, v = self._split_qkv(mixed)
        cp_group = self.core_attention.cp_group
        if rotary_pos_emb is not None:
            if cp_group is not None:  # this rank's tokens sit at global positions of the padded sequences
                cp = {"cp_size": dist.get_world_size(cp_group), "cp_rank": dist.get_rank(cp_group)}
                q = apply_rotary_pos_emb(q, rotary_pos_emb, "thd", cu_seqlens_q_padded, **cp)
                k = apply_rotary_pos_emb(k, rotary_pos_emb, "thd", cu_seqlens_q_padded, **cp)
            else:
                q = apply_rotary_pos_emb(q, rotary_pos_emb, self.qkv_format, cu_seqlens_q)
                k = apply_rotary_pos_emb(k, rotary_pos_emb, self.qkv_format, cu_seqlens_q)
        context = self.core_attention(
            q,
            k,
            v,
            attention_mask=attention_mask,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
        )
        out = self.proj(context)
        return (out, normed) if self.return_layernorm_output else out


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
