# Copied from common/context_parallel.py — edit the source, then run ci/check_copies.py --fix
"""Context parallelism on the data side: full context-parallel batches, and each CP rank's share of them.

One data flow for every recipe: the dataloader yields *full* batches that are ready to split (every sequence
padded to a multiple of ``2 * cp_size``; for causal LM the targets already shifted), all ranks of a CP group read
the same batches, and the training loop keeps its own share with :func:`shard_for_context_parallel` right before
the forward pass. Anything computed from the full batch (gradient-accumulation weights, token counts) is then the
same on every rank of the group.

The split is TransformerEngine's load-balanced layout for causal attention: every sequence is cut into
``2 * cp_size`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``
(``torch_layers.context_parallel_positions``, which the model also uses for rotary positions). Sequence boundaries
(``cu_seq_lens_*``) stay global. A BSHD batch is split the same way, each row being one sequence.

- :func:`context_parallel_batch`: a packed causal-LM THD batch -> the full context-parallel batch (pads every
  sequence, shifts targets *before* the split: a rank's next token may live on another rank).
- :func:`shard_for_context_parallel`: full batch -> one rank's share (BSHD or THD; every per-token tensor).
- :func:`unshard_context_parallel`: the inverse, for tests and debugging.
"""

import torch
import torch.nn.functional as F
from torch_layers import context_parallel_positions


IGNORE_INDEX = -100


def context_parallel_batch(batch: dict, cp_size: int, pad_token_id: int) -> dict:
    """The full context-parallel version of a packed causal-LM THD ``batch`` (``input_ids``/``labels`` [1, T]).

    The padded boundaries serve as the real ones too: causal attention never lets a real token see the padding
    after it, and TE leaves rows it is told to skip unwritten.
    """
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


def _split_boundaries(batch: dict) -> torch.Tensor:
    """The boundaries the split follows: the padded THD ones, or one sequence per BSHD row."""
    if "cu_seq_lens_q_padded" in batch:
        return batch["cu_seq_lens_q_padded"]
    if "cu_seq_lens_q" in batch:
        raise ValueError("not a context-parallel THD batch (no cu_seq_lens_q_padded): pad it for context parallelism")
    return torch.tensor([0, batch["input_ids"].shape[1]], dtype=torch.int32)


def _per_token_keys(batch: dict, length: int) -> list[str]:
    return [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length]


def _rows_of_rank(boundaries: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    lengths = boundaries[1:] - boundaries[:-1]
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(f"sequence lengths {lengths.tolist()} are not all multiples of 2 * cp_size = {2 * cp_size}")
    local_lengths = lengths // cp_size
    starts = torch.repeat_interleave(boundaries[:-1].long(), local_lengths)
    return starts + context_parallel_positions(boundaries, cp_size, cp_rank)


def shard_for_context_parallel(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """CP rank ``cp_rank``'s share of a full context-parallel batch: per-token tensors cut, boundaries kept."""
    boundaries = _split_boundaries(batch)
    rows = _rows_of_rank(boundaries, cp_rank, cp_size)
    keys = _per_token_keys(batch, int(boundaries[-1]))
    return {key: value[:, rows] if key in keys else value for key, value in batch.items()}


def unshard_context_parallel(shards: list[dict]) -> dict:
    """The full batch again from the shards of all CP ranks, given in rank order (inverse of the above)."""
    cp_size = len(shards)
    first = shards[0]
    if "cu_seq_lens_q_padded" in first:
        boundaries = first["cu_seq_lens_q_padded"]
    else:
        boundaries = torch.tensor([0, first["input_ids"].shape[1] * cp_size], dtype=torch.int32)
    full = dict(first)
    for key in _per_token_keys(first, int(boundaries[-1]) // cp_size):
        local = first[key]
        full[key] = torch.empty((local.shape[0], int(boundaries[-1]), *local.shape[2:]), dtype=local.dtype)
        for rank, shard in enumerate(shards):
            full[key][:, _rows_of_rank(boundaries, rank, cp_size)] = shard[key]
    return full
