"""Causal-LM labels and batch collation for genomic Llama pre-training: pad (BSHD) or pack (THD) windows.

A *window* is a 1-D array of token ids cut from one tokenized sequence (``<bos>`` + bases + ``<eos>``) by
``sequence_windows.window_starts``. Labels are the input tokens themselves (the model shifts them inside, per sequence), with
two genomic twists:

- ``uppercase_labels``: soft-masked (lowercase) bases are predicted as their uppercase base, so the model is not
  asked to guess a repeat-masking convention;
- ``mask_degenerate_bases``: any base that is not A/C/G/T (N, IUPAC codes, unknown characters) gets label -100,
  so it is never a target. ``<bos>`` is never a target (it is always first); ``<eos>`` is.

Packing (THD) concatenates windows into exactly ``token_budget`` tokens: a window that does not fit is split, its
head ends this batch and its tail starts the next one (as its own sequence, so attention never crosses).

Context-parallel batches are padded from the THD batches made here, in ``context_parallel.py``. The scored-token
counts of ``grad_accumulation.count_targets`` weight the micro-batches of a step (``token_weights``).
"""

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from sequence_windows import full_windows_first


IGNORE_INDEX = -100
BASES = "ACGT"


def pad_token_id(tokenizer) -> int:
    """What padding looks like in a batch: the tokenizer's pad token, or ``<eos>`` for tokenizers without one
    (Llama 3's). Padding is never a target anyway."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class LabelMaker:
    """Maps input token ids to label ids with a lookup table (uppercasing, degenerate-base masking)."""

    def __init__(self, tokenizer, uppercase_labels: bool = True, mask_degenerate_bases: bool = True):
        size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        table = np.arange(size, dtype=np.int64)
        if not (uppercase_labels or mask_degenerate_bases):  # natural language: labels are the inputs
            ids = {}
        else:
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


def collate_bshd(windows: list[np.ndarray], labels: LabelMaker, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``windows`` to the longest: ``input_ids``, ``attention_mask`` and ``labels`` [batch, seq]."""
    longest = max(len(w) for w in windows)
    input_ids = np.full((len(windows), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(windows), longest), dtype=np.int64)
    for row, window in enumerate(windows):
        input_ids[row, : len(window)] = window
        mask[row, : len(window)] = 1
    label_ids = np.where(mask == 1, labels(input_ids), IGNORE_INDEX)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(label_ids),
    }


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


def pack_windows(
    windows: Iterable[np.ndarray], token_budget: int, split_samples: bool = True
) -> Iterator[list[np.ndarray]]:
    """Group ``windows`` into lists of pieces of ``token_budget`` tokens in all (the last group may be short).

    With ``split_samples`` a window that overflows the budget is split so every group is exactly full; without it
    the window moves whole to the next group (a window longer than the budget is then an error).
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    group, used = [], 0
    for window in windows:
        while len(window):
            room = token_budget - used
            if len(window) <= room:
                group.append(window)
                used += len(window)
                window = window[:0]
            elif split_samples:
                group.append(window[:room])
                window = window[room:]
                used = token_budget
            elif len(window) > token_budget:
                raise ValueError(f"a window of {len(window)} tokens exceeds token_budget={token_budget}")
            else:
                yield group
                group, used = [], 0
                continue
            if used == token_budget:
                yield group
                group, used = [], 0
    if group:
        yield group
