"""Labels and batches for autoregressive DNA pre-training: pad (BSHD) or pack (THD) windows.

A *window* is a 1-D array of token ids cut from one tokenized sequence (``<bos>`` + bases + ``<eos>``) by
``sequence_windows.sequence_windows``: ``<bos>`` appears only in the first window of a sequence and ``<eos>`` only in
its last one, so an interior window of a long contig is neither a beginning nor an end, and the model is never taught
that genomes start or stop every 8,192 bases.

Labels are the input tokens (the model shifts them inside, per packed sequence) with two genomic rules:

- ``uppercase_labels``: a soft-masked (lowercase) base is predicted as its uppercase base. The input keeps the
  lowercase token, so the model may use the repeat annotation as context, but it is never asked to guess it;
- ``mask_degenerate_bases``: every base other than A/C/G/T (N, IUPAC codes, anything unexpected) gets label -100,
  so it is never a target. ``<bos>`` and ``<pad>`` are never targets; ``<eos>`` is.

THD packing lays pieces end to end in one row of exactly ``token_budget`` tokens. A piece is a window or, when a
window does not fit, its head (the tail starts the next batch as a sequence of its own: attention never crosses).

Context-parallel batches are padded from the THD batches made here, in ``context_parallel.py``. The scored-token
counts of ``grad_accumulation.count_targets`` weight the micro-batches of a step (``token_weights``).
"""

import numpy as np
import torch
from sequence_windows import full_windows_first


IGNORE_INDEX = -100
BASES = "ACGT"


def pad_token_id(tokenizer) -> int:
    """What padding looks like in a batch: the tokenizer's pad token, or ``<eos>`` for tokenizers without one.
    Padding is never a target anyway."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class LabelMaker:
    """Maps input token ids to label ids through a lookup table (uppercasing, degenerate-base masking)."""

    def __init__(self, tokenizer, uppercase_labels: bool = True, mask_degenerate_bases: bool = True):
        size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        table = np.arange(size, dtype=np.int64)
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in BASES + BASES.lower()}
        if uppercase_labels:
            for base in BASES:
                table[ids[base.lower()]] = ids[base]
        if mask_degenerate_bases:
            keep = set(ids.values()) | {tokenizer.eos_token_id}
            table[[i for i in range(size) if i not in keep]] = IGNORE_INDEX
        table[tokenizer.bos_token_id] = IGNORE_INDEX
        if tokenizer.pad_token_id is not None:
            table[tokenizer.pad_token_id] = IGNORE_INDEX
        self.table = table

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        return self.table[input_ids]


def collate_thd(pieces: list[np.ndarray], labels: LabelMaker, window: int | None = None) -> dict:
    """Concatenate ``pieces`` into one packed row [1, tokens] with Hugging Face's flash-attention argument names.

    Given the ``window`` length, pieces of exactly that length go first (``sequence_windows.full_windows_first``) and
    ``leading_full_sequences`` says how many there are: the model's fused layers attend over them as one dense batch.
    """
    leading_full = 0
    if window is not None:
        pieces, leading_full = full_windows_first(pieces, window)
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    input_ids = np.concatenate(pieces).astype(np.int64)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = int(lengths.max())
    return {
        "input_ids": torch.from_numpy(input_ids)[None],
        "labels": torch.from_numpy(labels(input_ids))[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
        "leading_full_sequences": leading_full,
    }


def collate_bshd(windows: list[np.ndarray], labels: LabelMaker, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``windows`` to the longest: ``input_ids``, ``attention_mask`` and ``labels`` [batch, seq]."""
    longest = max(len(w) for w in windows)
    input_ids = np.full((len(windows), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(windows), longest), dtype=np.int64)
    for row, window in enumerate(windows):
        input_ids[row, : len(window)] = window
        mask[row, : len(window)] = 1
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(np.where(mask == 1, labels(input_ids), IGNORE_INDEX)),
    }
