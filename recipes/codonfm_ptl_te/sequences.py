# Copied from models/codonfm/codonfm_te/sequences.py — edit the source, then run ci/check_copies.py --fix
"""Coding sequences to codon token ids: the CodonFM vocabulary and what happens to sequences that are not clean codons.

The vocabulary is the published Encodon one: five special tokens, then the 64 DNA codons in ``itertools.product("ACGT",
repeat=3)`` order, 69 ids in all. RNA input (``U``) reads as DNA (``T``): the published RNA tokenizer gives the same ids
to the same codons. A sequence becomes ``<CLS>`` + one id per codon + ``<SEP>``.

A sequence that is not a whole number of clean codons (a length not divisible by 3, or a character other than
A/C/G/T/U, such as ``N``) is handled by a *policy*:

* ``error`` (the default): refuse it with a message that names the sequence, the problem and the position;
* ``skip``: leave the sequence out (the caller counts and reports how many);
* ``unk``: keep it; a codon with a non-ACGT(U) base and a trailing partial codon each become one ``<UNK>``.

Unlike the published regex tokenizer, which re-reads a sequence one character at a time after a bad base and so shifts
the reading frame, every codon here is read in frame: position ``i`` of the sequence is always codon ``i // 3``.
Case and whitespace do not matter (soft-masked lowercase reads as uppercase).

This file depends on numpy only, so data loaders (worker processes) use it without importing a tokenizer.
"""

import itertools
import re

import numpy as np


SPECIAL_TOKENS = ("<CLS>", "<SEP>", "<UNK>", "<PAD>", "<MASK>")
CLS_ID, SEP_ID, UNK_ID, PAD_ID, MASK_ID = range(len(SPECIAL_TOKENS))
CODONS = tuple("".join(bases) for bases in itertools.product("ACGT", repeat=3))
VOCAB = {token: index for index, token in enumerate(SPECIAL_TOKENS + CODONS)}
VOCAB_SIZE = len(VOCAB)  # 69
FIRST_CODON_ID = len(SPECIAL_TOKENS)  # codon ids are FIRST_CODON_ID .. VOCAB_SIZE - 1
POLICIES = ("error", "skip", "unk")

_WHITESPACE = re.compile(r"\s+")
_NOT_A_BASE = re.compile(r"[^ACGT]")
# Base -> 0..3 for the codon id arithmetic; every other byte -> 4 (marks the codon as unknown).
_BASE_INDEX = np.full(256, 4, dtype=np.int64)
for _index, _base in enumerate("ACGT"):
    _BASE_INDEX[ord(_base)] = _index


class InvalidCodingSequence(ValueError):
    """A sequence that the ``error`` policy refuses; the message says which, what is wrong, and how to proceed."""


def clean_sequence(sequence: str) -> str:
    """Uppercase, without whitespace, RNA read as DNA (``U`` -> ``T``)."""
    return _WHITESPACE.sub("", sequence).upper().replace("U", "T")


def sequence_problem(cleaned: str) -> str | None:
    """What keeps a cleaned sequence from being whole clean codons, or None."""
    if not cleaned:
        return "it is empty"
    bad = _NOT_A_BASE.search(cleaned)
    if bad is not None:
        return f"it contains {bad.group()!r} at position {bad.start()} (only A, C, G, T and U are codon bases)"
    if len(cleaned) % 3:
        return f"its length {len(cleaned)} is not a multiple of 3"
    return None


def check_coding_sequence(sequence: str, policy: str = "error", name: str | None = None) -> str | None:
    """The cleaned sequence, or None when ``policy`` is ``skip`` and the sequence is not clean codons.

    Raises ``InvalidCodingSequence`` under the ``error`` policy, and ``ValueError`` for an unknown policy. An empty
    sequence is never kept: it has no codon to learn from (``unk`` drops it like ``skip``).
    """
    if policy not in POLICIES:
        raise ValueError(f"invalid_codon_policy must be one of {POLICIES}, got {policy!r}")
    cleaned = clean_sequence(sequence)
    problem = sequence_problem(cleaned)
    if problem is None:
        return cleaned
    if policy == "error":
        label = f"sequence {name!r}" if name is not None else "a sequence"
        raise InvalidCodingSequence(
            f"{label} is not a coding sequence of whole codons: {problem}. Fix the input, or set "
            "invalid_codon_policy to 'skip' (leave such sequences out) or 'unk' (read bad codons as <UNK>)"
        )
    if policy == "skip" or not cleaned:
        return None
    return cleaned


def encode(sequence: str, add_special_tokens: bool = True, max_codons: int | None = None) -> np.ndarray:
    """Token ids (int64) of a sequence: ``<CLS>`` codons ``<SEP>``, truncated to ``max_codons`` codons.

    The sequence is cleaned first (``clean_sequence``). A codon with a base outside ACGT, and a trailing partial
    codon, become ``<UNK>``.
    """
    cleaned = clean_sequence(sequence)
    n_codons = -(-len(cleaned) // 3)
    if max_codons is not None:
        n_codons = min(n_codons, max_codons)
    raw = np.frombuffer(cleaned[: 3 * n_codons].encode("ascii", errors="replace"), dtype=np.uint8)
    padded = np.full(3 * n_codons, ord("N"), dtype=np.uint8)
    padded[: len(raw)] = raw
    bases = _BASE_INDEX[padded].reshape(n_codons, 3)
    ids = FIRST_CODON_ID + 16 * bases[:, 0] + 4 * bases[:, 1] + bases[:, 2]
    ids[(bases == 4).any(axis=1)] = UNK_ID
    if add_special_tokens:
        ids = np.concatenate([[CLS_ID], ids, [SEP_ID]])
    return ids.astype(np.int64)


def decode(ids) -> str:
    """The codon string of token ids; special tokens are left out, ``<UNK>`` reads as ``NNN``."""
    tokens = SPECIAL_TOKENS + CODONS
    return "".join("NNN" if int(i) == UNK_ID else tokens[int(i)] for i in ids if int(i) == UNK_ID or int(i) >= 5)
