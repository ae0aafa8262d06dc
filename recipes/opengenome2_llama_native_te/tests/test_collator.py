"""Windows (the shared ``sequence_windows`` rule), <bos>/<eos> placement, labels, packing and the scored-token counts
that weight gradient accumulation, checked against hand-built expectations."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from collator import IGNORE_INDEX, LabelMaker, collate_bshd, collate_thd, pad_token_id
from grad_accumulation import count_targets, token_weights
from sequence_windows import sequence_windows, window_starts


BOS, EOS = 1, 2


def ids(tokenizer, text: str) -> np.ndarray:
    return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.uint8)


@pytest.mark.parametrize(
    ("length", "window", "overlap", "expected"),
    [
        (5, 8, 0, [0]),
        (8, 8, 2, [0]),
        (9, 8, 2, [0, 6]),  # the second window holds the 2 overlapping tokens and 1 new one
        (20, 8, 2, [0, 6, 12]),  # 12 + 8 = 20 reaches the end exactly
        (21, 8, 2, [0, 6, 12, 18]),  # a short last window, not one moved back over its neighbour
        (16, 8, 0, [0, 8]),
    ],
)
def test_window_starts(length, window, overlap, expected):
    starts = window_starts(length, window, overlap)
    assert starts == expected
    covered = set().union(*(range(s, min(s + window, length)) for s in starts))
    assert covered == set(range(length))


@pytest.mark.parametrize(("window", "overlap"), [(0, 0), (8, 8), (8, -1)])
def test_window_starts_rejects_bad_settings(window, overlap):
    with pytest.raises(ValueError):
        window_starts(100, window, overlap)


def test_bos_only_on_the_first_window_and_eos_only_on_the_last():
    bases = np.arange(10, 30, dtype=np.uint8)  # 20 bases -> 22 tokens with <bos> and <eos>
    windows = sequence_windows(bases, window=8, overlap=2, bos_token_id=BOS, eos_token_id=EOS)
    # Token stream: <bos> b0..b19 <eos>; window starts 0, 6, 12, 18 (by hand).
    stream = [BOS, *range(10, 30), EOS]
    assert [w.tolist() for w in windows] == [stream[0:8], stream[6:14], stream[12:20], stream[18:22]]
    assert windows[0][0] == BOS and all(BOS not in w.tolist() for w in windows[1:])
    assert windows[-1][-1] == EOS and all(EOS not in w.tolist() for w in windows[:-1])
    # An interior window starts and ends with plain bases.
    assert windows[1][0] == 15 and windows[1][-1] == 22


def test_a_short_sequence_is_one_window_with_both_ends():
    windows = sequence_windows(np.array([65, 67], dtype=np.uint8), 8, 2, BOS, EOS)
    assert [w.tolist() for w in windows] == [[BOS, 65, 67, EOS]]


def test_chunks_that_are_not_sequence_ends_get_no_marker():
    bases = np.array([65, 67, 71], dtype=np.uint8)
    assert sequence_windows(bases, 8, 0, None, EOS)[0].tolist() == [65, 67, 71, EOS]  # a last chunk
    assert sequence_windows(bases, 8, 0, BOS, None)[0].tolist() == [BOS, 65, 67, 71]  # a first chunk
    assert sequence_windows(bases, 8, 0, None, None)[0].tolist() == [65, 67, 71]  # an interior chunk


def test_labels_uppercase_soft_masked_bases_and_mask_degenerate_ones(tokenizer):
    inputs = np.array([BOS, *ids(tokenizer, "ACgtNRYKnWa"), EOS])
    labels = LabelMaker(tokenizer)(inputs)
    a, c, g, t = (ord(b) for b in "ACGT")  # the nucleotide tokenizer maps a base to its ASCII code
    expected = [IGNORE_INDEX, a, c, g, t] + [IGNORE_INDEX] * 6 + [a, EOS]
    assert labels.tolist() == expected
    assert inputs[3] == ord("g")  # the input keeps the soft-mask information


def test_label_rules_can_be_switched_off(tokenizer):
    inputs = ids(tokenizer, "AcN")
    assert LabelMaker(tokenizer, False, False)(inputs).tolist() == inputs.tolist()
    assert LabelMaker(tokenizer, True, False)(inputs).tolist() == [ord("A"), ord("C"), ord("N")]
    assert LabelMaker(tokenizer, False, True)(inputs).tolist() == [ord("A"), ord("c"), IGNORE_INDEX]


def test_thd_batch_boundaries(tokenizer):
    batch = collate_thd([ids(tokenizer, "ACG"), ids(tokenizer, "TTTTT")], LabelMaker(tokenizer))
    assert batch["input_ids"].shape == (1, 8)
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 5


def test_bshd_pads_right_and_ignores_padding(tokenizer):
    batch = collate_bshd(
        [ids(tokenizer, "ACGT"), ids(tokenizer, "GA")], LabelMaker(tokenizer), pad_token_id(tokenizer)
    )
    assert batch["input_ids"][1].tolist() == [ord("G"), ord("A"), tokenizer.pad_token_id, tokenizer.pad_token_id]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"][1].tolist() == [ord("G"), ord("A"), IGNORE_INDEX, IGNORE_INDEX]
    # A tokenizer without a pad token (Llama 3's) pads with <eos>; padding is never a target either way.
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=EOS)) == EOS


def test_count_targets_and_token_weights_by_hand(tokenizer):
    labels = LabelMaker(tokenizer)
    # BSHD: "ACNG" scores C, G (A is first, N masked); "TT" scores the second T.
    bshd = collate_bshd([ids(tokenizer, "ACNG"), ids(tokenizer, "TT")], labels, tokenizer.pad_token_id)
    assert count_targets(bshd, causal_lm=True) == 3
    # THD: "ACG" | "NTT" | "A": scored C, G | T, T | nothing.
    thd = collate_thd([ids(tokenizer, "ACG"), ids(tokenizer, "NTT"), ids(tokenizer, "A")], labels)
    assert count_targets(thd, causal_lm=True) == 4
    assert token_weights([count_targets(bshd, causal_lm=True), count_targets(thd, causal_lm=True)]) == pytest.approx(
        [3 / 7, 4 / 7]
    )
    empty = collate_thd([ids(tokenizer, "N")], labels)
    assert count_targets(empty, causal_lm=True) == 0
    assert token_weights([count_targets(empty, causal_lm=True)] * 2) == [0.5, 0.5]


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
