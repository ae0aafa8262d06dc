"""Causal-LM batches for context parallelism: from a packed THD batch to each CP rank's share of it.

``context_parallel_batch`` turns a THD batch (``input_ids``/``labels`` [1, T], ``cu_seq_lens_q``) into the full
context-parallel batch: every sequence padded to a multiple of ``2 * cp_size``, and targets shifted to the next
token *before* any split (``shift_labels``: a CP rank's next token may live on another rank). The padded boundaries
serve as the real ones too: causal attention never lets a real token see the padding after it, and TE leaves rows it
is told to skip unwritten. ``shard_for_context_parallel`` then keeps CP rank r's chunks r and ``2 * cp_size - 1 - r``
of every sequence, TransformerEngine's load-balanced layout for causal attention; the boundaries stay global.

All ranks of a CP group build the same full batch (they read the same data) and keep their own shard, so anything
computed from the full batch, such as gradient-accumulation weights, is the same on every rank of the group.
"""

import torch
import torch.nn.functional as F
from collator import IGNORE_INDEX
from torch_layers import context_parallel_positions


def context_parallel_batch(batch: dict, cp_size: int, pad_token_id: int) -> dict:
    """The full context-parallel version of the THD ``batch`` (see the module docstring)."""
    if "cu_seq_lens_q" not in batch or "labels" not in batch:
        raise ValueError("context parallelism needs THD batches with labels (dataset.input_format=thd)")
    cu = batch["cu_seq_lens_q"].long()
    lengths = cu[1:] - cu[:-1]
    multiple = 2 * cp_size
    padded_lengths = (lengths + multiple - 1) // multiple * multiple
    padded_cu = F.pad(padded_lengths.cumsum(0), (1, 0))
    total = int(padded_cu[-1])
    # Where each real token goes in the padded layout.
    sequence_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    destination = torch.arange(int(cu[-1])) - cu[:-1][sequence_of_token] + padded_cu[:-1][sequence_of_token]

    input_ids = torch.full((total,), pad_token_id, dtype=batch["input_ids"].dtype)
    input_ids[destination] = batch["input_ids"][0]
    # Token i is scored on label i + 1 of its own sequence; a sequence's last token (and all padding) on nothing.
    labels = batch["labels"][0]
    next_labels = F.pad(labels[1:], (0, 1), value=IGNORE_INDEX)
    next_labels[(cu[1:] - 1)[lengths > 0]] = IGNORE_INDEX
    shift_labels = torch.full((total,), IGNORE_INDEX, dtype=labels.dtype)
    shift_labels[destination] = next_labels

    boundaries = padded_cu.to(torch.int32)
    longest = int(padded_lengths.max())
    return {
        "input_ids": input_ids[None],
        "shift_labels": shift_labels[None],
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries.clone(),
        "cu_seq_lens_q_padded": boundaries.clone(),
        "cu_seq_lens_k_padded": boundaries.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
    }


def shard_for_context_parallel(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """CP rank ``cp_rank``'s part of a full context-parallel batch (per-token tensors cut, boundaries kept)."""
    if "cu_seq_lens_q_padded" not in batch:
        raise ValueError(
            "not a context-parallel batch (no cu_seq_lens_q_padded): build it with context_parallel_batch"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    cu = batch["cu_seq_lens_q_padded"]
    local_lengths = (cu[1:] - cu[:-1]) // cp_size
    rows = torch.repeat_interleave(cu[:-1].long(), local_lengths) + context_parallel_positions(cu, cp_size, cp_rank)
    return {key: value[:, rows] if key in ("input_ids", "shift_labels") else value for key, value in batch.items()}
