# Copied from common/packing.py — edit the source, then run ci/check_copies.py --fix
"""Packed model inputs, shared by the NV models (ESM-2, Llama 3): every forward runs on tokens laid end to end.

``pack_inputs`` validates one of three input contracts and returns a ``PackedBatch``:

* BSHD: ``input_ids`` [batch, seq] and an optional 0/1 ``attention_mask`` (left or right padding); the padding is
  removed on the way in and put back on the way out (``PackedBatch.unpack``);
* THD: ``input_ids`` [1, tokens] with ``cu_seq_lens_q`` (Hugging Face's flash-attention names), no mask, and
  optionally ``leading_full_sequences``: how many of the first sequences are ``max_length_q`` tokens long (collators
  that put full windows first say so; fused layers attend over those as one dense batch);
* context-parallel THD: this rank's share of every sequence, with the global ``cu_seq_lens_q`` and
  ``cu_seq_lens_q_padded`` (see ``_pack_context_parallel``), once the model has a CP group.

Checks that look at tensor values use ``torch._assert_async`` on CUDA, so validation costs no host-device sync.
``token_mean_loss`` is the loss every head uses: the mean over labelled tokens, reduced over a CP group if any;
``head_logits_and_loss`` runs a per-token head on every token, or on the labelled ones only (training).

This file travels with the modeling files (recipes carry copies, exports ship it beside them).
"""

import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F


IGNORE_INDEX = -100

# Models with FP8 layers pad their packed token count to a multiple of this (one pseudo-sequence appended; FP8 GEMMs
# need 16). Not 16: TE's fused FP8 casts of gradients (the output gradient's cast with its bias gradient, dGELU's cast)
# run their runtime-compiled fast kernels only for token counts divisible by 32, and slower general kernels otherwise;
# and 128 measured faster than 32. ESM-2 650M under DelayedScaling, 49,152-token batches, one H200: 148,009 tokens/s
# padded to 16, 150,862 to 32, 158,639 to 128 (docs/benchmarks.md); it costs at most 127 padding tokens per batch.
FP8_TOKEN_ALIGNMENT = 128


@dataclass
class PackedBatch:
    """Tokens of a batch laid end to end, with what is needed to undo the packing."""

    input_ids: torch.Tensor  # [tokens]
    cu_seqlens: torch.Tensor  # [sequences + 1], int32
    max_seqlen: int
    padded_shape: tuple[int, int] | None = None  # (batch, seq) when the input was BSHD
    token_index: torch.Tensor | None = None  # flat positions of real tokens in the BSHD input
    num_real_tokens: int | None = None  # tokens before alignment padding was appended
    # Context parallelism: the full batch's padded boundaries ([0, ...] in global token counts); the local tokens
    # are this rank's share (1 / cp_size of every padded sequence, see torch_layers.context_parallel_positions).
    cu_seqlens_padded: torch.Tensor | None = None
    cp_group: object | None = None
    # THD: the first this many sequences are max_seqlen tokens long (checked in pack_inputs).
    leading_full_sequences: int = 0

    def local_segment_lengths(self) -> torch.Tensor:
        """Tokens of each sequence held here (all of it, or this rank's share under context parallelism)."""
        if self.cu_seqlens_padded is None:
            return self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        cp_size = torch.distributed.get_world_size(self.cp_group)
        return (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]) // cp_size

    def positions(self) -> torch.Tensor:
        """Each packed token's position within its own sequence, e.g. cu_seqlens [0, 3, 5] -> [0, 1, 2, 0, 1]: the
        index of a learned absolute position embedding (BSHD input padded on the right gives the same positions)."""
        if self.cu_seqlens_padded is not None:
            raise NotImplementedError("absolute positions under context parallelism are not implemented")
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        total = self.input_ids.shape[0]
        starts = torch.repeat_interleave(self.cu_seqlens[:-1], lengths, output_size=total)
        return torch.arange(total, device=self.input_ids.device) - starts

    def layer_boundaries(self) -> dict:
        """Keyword arguments that tell a TE (or twin) layer where the sequences are."""
        boundaries = {
            "cu_seqlens_q": self.cu_seqlens,
            "cu_seqlens_kv": self.cu_seqlens,
            "max_seqlen_q": self.max_seqlen,
            "max_seqlen_kv": self.max_seqlen,
        }
        if self.cu_seqlens_padded is not None:
            boundaries |= {
                "cu_seqlens_q_padded": self.cu_seqlens_padded,
                "cu_seqlens_kv_padded": self.cu_seqlens_padded,
            }
        return boundaries

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> the caller's layout: [batch, seq, ...] for BSHD (zeros at padding), [1, tokens, ...] for THD."""
        if self.num_real_tokens is not None:
            packed = packed[: self.num_real_tokens]
        if self.padded_shape is None:
            return packed.unsqueeze(0)
        batch, seq = self.padded_shape
        out = packed.new_zeros(batch * seq, *packed.shape[1:])
        out[self.token_index] = packed
        return out.view(batch, seq, *packed.shape[1:])

    def pack_like(self, values: torch.Tensor) -> torch.Tensor:
        """Apply the same packing to a per-token tensor given in the caller's layout (e.g. labels)."""
        flat = values.reshape(-1) if self.padded_shape is None else values.reshape(-1)[self.token_index]
        extra = self.input_ids.shape[0] - flat.shape[0]
        return F.pad(flat, (0, extra), value=IGNORE_INDEX) if extra else flat

    def next_token_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Packed labels shifted for next-token prediction: token i is scored on label i + 1 of its own sequence;
        the last token of every sequence (and alignment padding) gets -100."""
        flat = labels.reshape(-1) if self.padded_shape is None else labels.reshape(-1)[self.token_index]
        shifted = F.pad(flat[1:], (0, 1), value=IGNORE_INDEX)
        # Mark each sequence's last token without a boolean-mask index (that would be a nonzero(), a host sync that
        # drains the GPU's queue once per forward): slot i + 1 of a buffer two longer than the labels stands for
        # token i, and ends outside the labels (an empty first sequence: -1; alignment padding: >= numel) are
        # clamped into the two spare slots, which are dropped.
        numel = flat.numel()
        slot = self.cu_seqlens[1:].long().clamp(0, numel + 1)  # (last token of the sequence) + 1
        is_last = torch.zeros(numel + 2, dtype=torch.bool, device=flat.device)
        is_last = is_last.index_fill(0, slot, True)[1 : numel + 1]
        shifted = shifted.masked_fill(is_last, IGNORE_INDEX)
        extra = self.input_ids.shape[0] - shifted.shape[0]
        return F.pad(shifted, (0, extra), value=IGNORE_INDEX) if extra else shifted


def check(condition: torch.Tensor | bool, message: str) -> None:
    """Raise on CPU; on CUDA use an asynchronous device assert so validation costs no host-device sync."""
    if isinstance(condition, torch.Tensor):
        if condition.device.type == "cuda":
            torch._assert_async(condition, message)
            return
        condition = bool(condition)
    if not condition:
        raise ValueError(message)


def pack_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
    max_length_q: int | None,
    pad_token_id: int,
    align_to: int = 1,
    cu_seq_lens_q_padded: torch.Tensor | None = None,
    cp_group=None,
    leading_full_sequences: int = 0,
) -> PackedBatch:
    """Validate BSHD, THD or context-parallel THD inputs and return them packed (see the module docstring).

    ``align_to`` > 1 (models with FP8 layers pass ``FP8_TOKEN_ALIGNMENT``) appends one padding pseudo-sequence.
    """
    if leading_full_sequences and (cu_seq_lens_q is None or cp_group is not None):
        raise ValueError(
            "leading_full_sequences describes a packed (THD) batch that is not split for context parallelism; "
            f"got {leading_full_sequences} with " + ("context parallelism" if cp_group is not None else "BSHD input")
        )
    if cp_group is not None:
        return _pack_context_parallel(
            input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_q_padded, max_length_q, cp_group
        )
    if cu_seq_lens_q_padded is not None:
        raise ValueError("cu_seq_lens_q_padded is for context parallelism: call set_context_parallel_group() first")
    if cu_seq_lens_q is None:
        packed = _pack_bshd(input_ids, attention_mask, cu_seq_lens_k)
    else:
        packed = _pack_thd(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q)
        packed.leading_full_sequences = _leading_full_sequences(packed, leading_full_sequences)

    remainder = packed.input_ids.numel() % align_to
    if remainder:
        extra = align_to - remainder
        packed.num_real_tokens = packed.input_ids.numel()
        packed.input_ids = F.pad(packed.input_ids, (0, extra), value=pad_token_id)
        packed.cu_seqlens = torch.cat([packed.cu_seqlens, packed.cu_seqlens[-1:] + extra])
        packed.max_seqlen = max(packed.max_seqlen, extra)
    return packed


def _pack_bshd(input_ids, attention_mask, cu_seq_lens_k) -> PackedBatch:
    if cu_seq_lens_k is not None:
        raise ValueError("cu_seq_lens_k was given without cu_seq_lens_q")
    if input_ids.dim() != 2:
        raise ValueError(f"BSHD input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if attention_mask.dtype != torch.bool:
        check(((attention_mask == 0) | (attention_mask == 1)).all(), "attention_mask must hold only 0 and 1")
    keep = attention_mask.reshape(-1).bool()
    token_index = keep.nonzero().squeeze(-1)
    lengths = attention_mask.bool().sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return PackedBatch(
        input_ids.reshape(-1)[token_index], cu_seqlens, input_ids.shape[1], tuple(input_ids.shape), token_index
    )


def _pack_thd(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q) -> PackedBatch:
    if attention_mask is not None:
        raise ValueError("THD input (cu_seq_lens_q) takes no attention_mask: sequence boundaries mark the padding")
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"THD input_ids must be [1, tokens] or [tokens], got shape {tuple(input_ids.shape)}")
    tokens = input_ids.reshape(-1)
    if cu_seq_lens_q.dim() != 1 or cu_seq_lens_q.numel() < 2 or cu_seq_lens_q.is_floating_point():
        raise ValueError(f"cu_seq_lens_q must be a 1-D integer tensor [sequences + 1], got {cu_seq_lens_q!r}")
    if cu_seq_lens_k is not None:
        if cu_seq_lens_k.shape != cu_seq_lens_q.shape:
            raise ValueError("self-attention needs cu_seq_lens_k == cu_seq_lens_q")
        check((cu_seq_lens_k == cu_seq_lens_q).all(), "self-attention needs cu_seq_lens_k == cu_seq_lens_q")
    check(cu_seq_lens_q[0] == 0, "cu_seq_lens_q must start at 0")
    check(
        cu_seq_lens_q[-1] == tokens.numel(),
        f"cu_seq_lens_q must end at the number of tokens ({tokens.numel()}); "
        + (f"it ends at {int(cu_seq_lens_q[-1])}" if cu_seq_lens_q.device.type == "cpu" else "it does not"),
    )
    check((cu_seq_lens_q[1:] >= cu_seq_lens_q[:-1]).all(), "cu_seq_lens_q must be non-decreasing")
    cu_seqlens = cu_seq_lens_q.to(torch.int32)
    if max_length_q is None:  # costs a host-device sync; collators pass it
        max_length_q = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedBatch(tokens, cu_seqlens, int(max_length_q))


def _leading_full_sequences(packed: PackedBatch, count) -> int:
    """``count``, checked: the first ``count`` sequences of ``packed`` are ``max_seqlen`` tokens long."""
    sequences = packed.cu_seqlens.numel() - 1
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or not 0 <= count <= sequences:
        raise ValueError(f"leading_full_sequences must be an int in [0, {sequences}] (the sequences), got {count!r}")
    count = int(count)  # a NumPy integer from a user's collator, too
    if count:
        lengths = packed.cu_seqlens[1 : count + 1] - packed.cu_seqlens[:count]
        check(
            (lengths == packed.max_seqlen).all(),
            f"leading_full_sequences={count}, but not all of the first {count} sequences are max_length_q = "
            f"{packed.max_seqlen} tokens long",
        )
    return count


def _pack_context_parallel(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_q_padded, max_length_q, cp_group):
    """THD input already split for context parallelism: local tokens, global real and padded boundaries.

    The recipes' collators pass the padded boundaries as both: TE's ring attention leaves the output rows of padding
    it is told to skip (real < padded) unwritten, and that garbage would reach the weight gradients.
    """
    if cu_seq_lens_q is None or cu_seq_lens_q_padded is None or attention_mask is not None:
        raise ValueError(
            "context parallelism takes THD input: input_ids [1, local tokens], cu_seq_lens_q and "
            "cu_seq_lens_q_padded (lengths padded to a multiple of 2 * cp_size), no attention_mask"
        )
    tokens = input_ids.reshape(-1)
    cp_size = torch.distributed.get_world_size(cp_group)
    check(
        cu_seq_lens_q_padded[-1] == tokens.numel() * cp_size,
        f"cu_seq_lens_q_padded must end at local tokens x cp_size ({tokens.numel()} x {cp_size})",
    )
    check(
        (cu_seq_lens_q_padded % (2 * cp_size) == 0).all(), "padded sequence lengths must be multiples of 2 * cp_size"
    )
    if max_length_q is None:  # costs a host-device sync; collators pass it
        max_length_q = int((cu_seq_lens_q_padded[1:] - cu_seq_lens_q_padded[:-1]).max())
    return PackedBatch(
        tokens,
        cu_seq_lens_q.to(torch.int32),
        int(max_length_q),
        cu_seqlens_padded=cu_seq_lens_q_padded.to(torch.int32),
        cp_group=cp_group,
    )


def token_mean_loss(logits: torch.Tensor, targets: torch.Tensor, cp_group=None) -> torch.Tensor:
    """Mean cross-entropy over labelled tokens (computed in float32); 0, not NaN, for a batch without any.

    Under context parallelism each rank holds part of the targets. The value returned is the mean over the whole
    CP group; the gradient is scaled so that the data-parallel gradient average over (dp x cp) ranks equals the
    average over dp of each group's mean.
    """
    loss_sum = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (targets != IGNORE_INDEX).sum()
    if cp_group is None:
        return loss_sum / count.clamp(min=1)
    totals = torch.stack([loss_sum.detach(), count.to(loss_sum.dtype)])
    torch.distributed.all_reduce(totals, group=cp_group)
    cp_size = torch.distributed.get_world_size(cp_group)
    local = loss_sum * cp_size / totals[1].clamp(min=1)
    return local - local.detach() + totals[0] / totals[1].clamp(min=1)


def labeled_token_index(labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[labelled tokens] int64: where the tokens that carry a label sit in the packed order the model uses
    (``PackedBatch.pack_like``: BSHD drops the masked-out positions, THD keeps its order), i.e. the rows
    ``labeled_logits_only`` runs the head on. Training loops compute it from the CPU batch and pass it as the
    forward's ``labeled_token_index``: found on the GPU instead, the count costs a host sync, which drains the GPU's
    queue once per micro-batch. Pinned when ``labels`` is, so that its copy to the GPU is asynchronous too."""
    flat = labels.reshape(-1)
    if attention_mask is not None:
        flat = flat[attention_mask.reshape(-1).bool()]
    index = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    return index.pin_memory() if labels.is_pinned() else index


def with_labeled_token_index(batch: dict) -> dict:
    """A CPU batch of model inputs (with ``labels``) plus its ``labeled_token_index``, for a training step that
    calls the model with ``labeled_logits_only=True``."""
    return {**batch, "labeled_token_index": labeled_token_index(batch["labels"], batch.get("attention_mask"))}


def head_logits_and_loss(
    head,
    hidden: torch.Tensor,
    targets: torch.Tensor | None,
    packed: PackedBatch,
    labeled_only: bool,
    labeled_index: torch.Tensor | None = None,
):
    """``(logits, loss)`` of a per-token head (an MLM decoder, a token classifier) over the encoder's packed output.

    ``labeled_only=False``: every token's logits, in the caller's layout (``packed.unpack``), and the loss when there
    are targets. ``labeled_only=True`` (the training loops' ``labeled_logits_only``): the head runs only on the tokens
    that have a label (the ~15% a masked LM scores) and the logits come back as [labelled tokens, vocab] in packed
    order; the loss is the same, without the head's GEMMs and the float32 softmax on rows the loss never reads.
    ``labeled_index`` (``labeled_token_index`` of the batch, computed by the caller on the CPU) says which rows those
    are; without it they are found on the device, at the cost of a host sync.
    """
    if not labeled_only:
        if labeled_index is not None:
            raise ValueError("labeled_token_index is for labeled_logits_only=True")
        logits = head(hidden)
        loss = None if targets is None else token_mean_loss(logits, targets, packed.cp_group)
        return packed.unpack(logits), loss
    if targets is None:
        raise ValueError("labeled_logits_only=True needs labels: they say which tokens get logits")
    is_labeled = targets != IGNORE_INDEX
    if labeled_index is None:
        labeled_index = is_labeled.nonzero().squeeze(1)  # a host sync: the row count sets the shape
    else:
        labeled_index = labeled_index.reshape(-1).to(targets.device, torch.long)
        check(
            (labeled_index.numel() == is_labeled.sum())
            & is_labeled[labeled_index].all()
            & (labeled_index[1:] > labeled_index[:-1]).all(),
            "labeled_token_index must list the labelled tokens in packed order (packing.labeled_token_index)",
        )
    logits = head(hidden.index_select(0, labeled_index))
    return logits, token_mean_loss(logits, targets.index_select(0, labeled_index), packed.cp_group)
