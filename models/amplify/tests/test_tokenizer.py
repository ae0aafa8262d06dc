"""The shipped fast tokenizer against the published AMPLIFY vocabulary and tokenization rule.

The reference encoder below is written from the published tokenizer's definition (one token per character, unknown
characters -> <unk>, <bos> ... <eos> around a sequence); the vocabulary list is the published one, in its order
(the checkpoints' tokenizer.json; see scripts/make_tokenizer.py for the source)."""

import pytest
from amplify_testing import TOKENIZER_DIR
from transformers import AutoTokenizer


PUBLISHED_VOCAB = ["<pad>", "<unk>", "<mask>", "<bos>", "<eos>", "|", *"LAGVSERTIDPKQNFYMHWC", "B"]

SEQUENCES = [
    "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRL",
    "ACDEFGHIKLMNPQRSTVWY",
    "B|MKT",  # B and the chain separator are in the vocabulary
    "XZUOJ",  # ambiguous and rare residues are not: each is <unk>
    "mktay",  # lowercase is not in the vocabulary
    "MK TA",  # neither is whitespace (one <unk> per character, as published)
    "",
]


def reference_encode(sequence: str) -> list[int]:
    ids = {token: index for index, token in enumerate(PUBLISHED_VOCAB)}
    return [ids["<bos>"], *(ids.get(ch, ids["<unk>"]) for ch in sequence), ids["<eos>"]]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_vocabulary_is_the_published_one_in_order(tokenizer):
    assert tokenizer.vocab_size == 27
    assert tokenizer.convert_ids_to_tokens(list(range(27))) == PUBLISHED_VOCAB
    assert (
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
        tokenizer.mask_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    ) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_single_sequences_match_the_published_rule(tokenizer, sequence):
    assert tokenizer(sequence)["input_ids"] == reference_encode(sequence)


def test_mask_token_written_out_is_one_token(tokenizer):
    assert tokenizer("MA<mask>K<mask>")["input_ids"] == [3, 22, 7, 2, 17, 2, 4]


def test_padded_batch_pads_right_with_pad_id_0(tokenizer):
    batch = tokenizer(SEQUENCES[1:4], padding=True)
    width = max(len(reference_encode(s)) for s in SEQUENCES[1:4])
    for sequence, ids, mask in zip(SEQUENCES[1:4], batch["input_ids"], batch["attention_mask"]):
        expected = reference_encode(sequence)
        assert ids == expected + [0] * (width - len(expected))
        assert mask == [1] * len(expected) + [0] * (width - len(expected))


def test_decode_round_trip(tokenizer):
    ids = tokenizer(SEQUENCES[1])["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == SEQUENCES[1]
