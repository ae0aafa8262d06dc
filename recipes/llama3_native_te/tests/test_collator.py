"""Windows, labels, padding and packing, checked against hand-built expectations."""

import numpy as np
import pytest
import torch
from collator import (
    IGNORE_INDEX,
    LabelMaker,
    collate_bshd,
    collate_thd,
    pack_windows,
    pad_token_id,
)
from context_parallel import context_parallel_batch, shard_for_context_parallel
from grad_accumulation import count_targets, token_weights
from recipe_paths import recipe_path
from sequence_windows import window_starts
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(recipe_path("tokenizer"))


def ids(tokenizer, text: str) -> np.ndarray:
    return np.array(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    ("length", "window", "overlap", "expected"),
    [
        (5, 8, 0, [0]),
        (8, 8, 2, [0]),
        (9, 8, 0, [0, 8]),  # one token too long: a full window and a short one, not a near-duplicate window
        (20, 8, 0, [0, 8, 16]),  # the last window is short (4 tokens)
        (20, 8, 2, [0, 6, 12]),  # stride 6 covers 20 exactly
        (21, 8, 2, [0, 6, 12, 18]),
    ],
)
def test_window_starts(length, window, overlap, expected):
    starts = window_starts(length, window, overlap)
    assert starts == expected
    covered = set().union(*(range(s, min(s + window, length)) for s in starts))
    assert covered == set(range(length))
    # Neighbours share exactly ``overlap`` tokens: no window is moved back over its neighbour.
    assert all(b - a == window - overlap for a, b in zip(starts, starts[1:]))


@pytest.mark.parametrize(("window", "overlap"), [(0, 0), (8, 8), (8, -1)])
def test_window_starts_rejects_bad_settings(window, overlap):
    with pytest.raises(ValueError):
        window_starts(100, window, overlap)


def test_labels_uppercase_and_mask_degenerate(tokenizer):
    inputs = np.concatenate([[tokenizer.bos_token_id], ids(tokenizer, "ACgtNRa"), [tokenizer.eos_token_id]])
    labels = LabelMaker(tokenizer, uppercase_labels=True, mask_degenerate_bases=True)(inputs)
    expected = [IGNORE_INDEX, *ids(tokenizer, "ACGT"), IGNORE_INDEX, IGNORE_INDEX, *ids(tokenizer, "A")]
    assert labels.tolist() == [*expected, tokenizer.eos_token_id]


def test_labels_without_uppercasing_or_masking(tokenizer):
    inputs = ids(tokenizer, "AcN")
    assert LabelMaker(tokenizer, False, False)(inputs).tolist() == inputs.tolist()
    assert LabelMaker(tokenizer, False, True)(inputs).tolist() == [*inputs[:2], IGNORE_INDEX]


def test_bshd_pads_right_and_ignores_padding(tokenizer):
    labels = LabelMaker(tokenizer)
    batch = collate_bshd([ids(tokenizer, "ACGT"), ids(tokenizer, "GA")], labels, tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, 4)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["input_ids"][1, 2:].tolist() == [tokenizer.pad_token_id] * 2
    assert batch["labels"][1].tolist() == [*ids(tokenizer, "GA"), IGNORE_INDEX, IGNORE_INDEX]


def test_packing_splits_windows_to_fill_the_budget_exactly():
    windows = [np.arange(n) + 100 * i for i, n in enumerate([5, 7, 3, 9, 4])]  # 28 tokens
    groups = list(pack_windows(iter(windows), token_budget=8))
    assert [sum(len(p) for p in g) for g in groups] == [8, 8, 8, 4]
    assert [[len(p) for p in g] for g in groups] == [[5, 3], [4, 3, 1], [8], [4]]
    # Nothing lost, nothing duplicated, order kept.
    assert np.concatenate([np.concatenate(g) for g in groups]).tolist() == np.concatenate(windows).tolist()


def test_packing_without_splitting_moves_whole_windows():
    windows = [np.arange(n) for n in [5, 7, 3]]
    groups = list(pack_windows(iter(windows), token_budget=8, split_samples=False))
    assert [[len(p) for p in g] for g in groups] == [[5], [7], [3]]
    with pytest.raises(ValueError, match="exceeds token_budget"):
        list(pack_windows(iter([np.arange(9)]), token_budget=8, split_samples=False))


def test_thd_sequence_boundaries(tokenizer):
    batch = collate_thd([ids(tokenizer, "ACG"), ids(tokenizer, "TTTTT")], LabelMaker(tokenizer))
    assert batch["input_ids"].shape == (1, 8)
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 5


def test_count_targets_by_hand(tokenizer):
    labels = LabelMaker(tokenizer)
    # BSHD: "ACNG" scores C, G (A is first, N masked); "TT" scores T.
    bshd = collate_bshd([ids(tokenizer, "ACNG"), ids(tokenizer, "TT")], labels, tokenizer.pad_token_id)
    assert count_targets(bshd, causal_lm=True) == 3
    # THD: sequences "ACG" | "NTT" | "A": scored C, G | T, T | (none).
    thd = collate_thd([ids(tokenizer, "ACG"), ids(tokenizer, "NTT"), ids(tokenizer, "A")], labels)
    assert count_targets(thd, causal_lm=True) == 4
    assert token_weights([count_targets(bshd, causal_lm=True), count_targets(thd, causal_lm=True)]) == pytest.approx(
        [3 / 7, 4 / 7]
    )
    empty = collate_thd([ids(tokenizer, "N")], labels)
    assert count_targets(empty, causal_lm=True) == 0
    assert token_weights([count_targets(empty, causal_lm=True)] * 2) == [0.5, 0.5]


def test_pad_token_id_falls_back_to_eos(tokenizer):
    assert pad_token_id(tokenizer) == tokenizer.pad_token_id
    no_pad = type("NoPad", (), {"pad_token_id": None, "eos_token_id": 2})()
    assert pad_token_id(no_pad) == 2


def test_context_parallel_batch_by_hand(tokenizer):
    """Two pieces (5 and 3 tokens), cp_size 2: each padded to a multiple of 4, targets shifted inside each piece."""
    labels = LabelMaker(tokenizer)
    first = np.array([1, *ids(tokenizer, "ACnT")])  # <bos> A C n T (n: degenerate, never a target)
    second = ids(tokenizer, "gta")  # the tail of a split window: no <bos>; lowercase predicted as uppercase
    batch = context_parallel_batch(collate_thd([first, second], labels), cp_size=2, pad_token_id=0)
    A, C, G, T = (tokenizer.convert_tokens_to_ids(b) for b in "ACGT")
    n, g, t, a = (tokenizer.convert_tokens_to_ids(b) for b in "ngta")
    assert batch["input_ids"][0].tolist() == [1, A, C, n, T, 0, 0, 0, g, t, a, 0]
    #                           next target of:  <bos> A  C     n  T(last) pad      g  t  a(last) pad
    assert batch["shift_labels"][0].tolist() == [A, C, -100, T, -100, -100, -100, -100, T, A, -100, -100]
    assert batch["cu_seq_lens_q_padded"].tolist() == [0, 8, 12] == batch["cu_seq_lens_q"].tolist()
    assert batch["max_length_q"] == 8 and "labels" not in batch
    assert count_targets(batch, causal_lm=True) == 5

    # Rank 0 keeps chunks 0 and 3 of every piece (chunks of 2 and 1 tokens), rank 1 chunks 1 and 2.
    shards = [shard_for_context_parallel(batch, rank, 2) for rank in (0, 1)]
    assert shards[0]["input_ids"][0].tolist() == [1, A, 0, 0, g, 0]
    assert shards[1]["input_ids"][0].tolist() == [C, n, T, 0, t, a]
    assert shards[1]["shift_labels"][0].tolist() == [-100, T, -100, -100, A, -100]
    assert shards[0]["cu_seq_lens_q_padded"].tolist() == [0, 8, 12]  # boundaries stay global
    with pytest.raises(ValueError, match="not a context-parallel THD batch"):
        shard_for_context_parallel(collate_thd([first], labels), 0, 2)
    with pytest.raises(ValueError, match="THD batches with labels"):
        context_parallel_batch(collate_bshd([first], labels, 0), 2, 0)


def test_thd_puts_full_windows_first_and_says_how_many(tokenizer):
    """Given the window length, pieces of exactly that length lead (each group in its order), their labels move with
    them, and ``leading_full_sequences`` counts them; without it the batch keeps its order and says 0."""
    labels = LabelMaker(tokenizer)
    pieces = [ids(tokenizer, text) for text in ("AC", "GGGG", "TN", "CCCC", "A")]
    batch = collate_thd(pieces, labels, window=4)
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 8, 10, 12, 13]
    assert batch["leading_full_sequences"] == 2
    assert batch["max_length_q"] == 4
    expected = np.concatenate([pieces[i] for i in (1, 3, 0, 2, 4)])
    assert batch["input_ids"][0].tolist() == expected.tolist()
    assert batch["labels"][0].tolist() == labels(expected).tolist()
    as_packed = collate_thd(pieces, labels)
    assert as_packed["leading_full_sequences"] == 0
    assert as_packed["cu_seq_lens_q"].tolist() == [0, 2, 6, 8, 12, 13]
    assert collate_thd(pieces[:1], labels, window=4)["leading_full_sequences"] == 0
