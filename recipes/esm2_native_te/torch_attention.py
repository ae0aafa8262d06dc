# Copied from common/torch_attention.py — edit the source, then run ci/check_copies.py --fix
"""Pure-PyTorch twins of TransformerEngine's attention: rotary embeddings (``apply_rotary_pos_emb``),
``DotProductAttention`` and ``MultiheadAttention``, with TE's constructor arguments (the subset this project uses),
parameter names, state-dict keys and numerics. Part of the torch backend, see torch_layers.py.

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


try:  # package import (models/*, exported checkpoints)
    from .torch_norm_linear import ExtraStateMixin, LayerNormLinear, Linear
except ImportError:  # flat copy inside a recipe folder
    from torch_norm_linear import ExtraStateMixin, LayerNormLinear, Linear

__all__ = ["DotProductAttention", "MultiheadAttention", "apply_rotary_pos_emb", "context_parallel_positions"]


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


class DotProductAttention(ExtraStateMixin, nn.Module):
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
