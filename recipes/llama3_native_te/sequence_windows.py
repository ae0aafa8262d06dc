# Copied from common/sequence_windows.py — edit the source, then run ci/check_copies.py --fix
"""Cutting long token sequences (genomes) into training windows: the one rule both Llama recipes use.

Windows of ``window`` tokens start ``window - overlap`` apart, from 0, until one reaches the end; the last one may be
short. (Moving the last window back to end exactly at the sequence end would repeat almost a whole window for a
sequence one token too long, and over-weight sequence ends.) ``<bos>``/``<eos>`` mark a sequence's true ends only,
so a window in the middle of a genome starts and ends with bases.
"""

import numpy as np


def window_starts(length: int, window: int, overlap: int) -> list[int]:
    """Offsets of the windows of ``window`` tokens, ``window - overlap`` apart, that together cover ``length``."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if not 0 <= overlap < window:
        raise ValueError(f"overlap must be in [0, window), got overlap={overlap}, window={window}")
    stride = window - overlap
    starts = [0]
    while starts[-1] + window < length:
        starts.append(starts[-1] + stride)
    return starts


def sequence_windows(
    tokens: np.ndarray,
    window: int,
    overlap: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
) -> list[np.ndarray]:
    """Cut one tokenized sequence into windows; ``<bos>``/``<eos>`` (None: leave out) mark its true ends only.

    A chunk of a longer sequence (e.g. written by a resharding script) passes None for the end that is not a true
    sequence boundary.
    """
    head = [] if bos_token_id is None else [bos_token_id]
    tail = [] if eos_token_id is None else [eos_token_id]
    tokens = np.concatenate([np.array(head, dtype=tokens.dtype), tokens, np.array(tail, dtype=tokens.dtype)])
    return [tokens[start : start + window] for start in window_starts(len(tokens), window, overlap)]


def full_windows_first(pieces: list[np.ndarray], window: int) -> tuple[list[np.ndarray], int]:
    """``pieces`` of one packed batch with those exactly ``window`` tokens long moved to the front (each group keeps
    its order), and how many those are.

    A packed batch so ordered tells the model that its first sequences are full windows (``leading_full_sequences``),
    and the fused layers then run their attention as one dense [windows, window] batch, which cuDNN runs faster than
    the same work packed (docs/benchmarks.md). The order changes nothing that is learned: every piece is a sequence
    of its own (attention never crosses pieces) and the loss is a mean over all tokens.
    """
    full = [piece for piece in pieces if len(piece) == window]
    rest = [piece for piece in pieces if len(piece) != window]
    return full + rest, len(full)
