"""The shipped fast tokenizer against ``codonfm_te.sequences`` (the vocabulary and ``encode``, the rule the data loaders
use), on the inputs a user gives: DNA, RNA, lowercase (soft-masked), whitespace, ``N`` and other non-bases, a trailing
partial codon, nothing."""

import pytest
from codonfm_testing import TOKENIZER_DIR
from transformers import AutoTokenizer

from codonfm_te.sequences import CODONS, SPECIAL_TOKENS, VOCAB, encode


SEQUENCES = [
    "ATGGCCAAGTTTGGACTGTAA",  # DNA
    "AUGGCCAAGUUUGGACUGUAA",  # RNA: the same ids
    "atggccAAGtttggactgtaa",  # soft-masked lowercase
    "ATG GCC\nAAG\tTTT ",  # whitespace anywhere
    "ATGNNNAAGTNA",  # N: <UNK> codons, the frame kept
    "ATGXYZAAG-*.",  # other characters: <UNK> codons
    "ATGGCCAA",  # a trailing partial codon: one <UNK>
    "A",
    "",
    "".join(CODONS),  # every codon once, in vocabulary order
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_vocabulary_is_the_published_one_in_order(tokenizer):
    assert tokenizer.vocab_size == 69 == len(VOCAB)
    assert tokenizer.convert_ids_to_tokens(list(range(69))) == list(SPECIAL_TOKENS + CODONS)
    ids = (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id)
    assert (*ids, tokenizer.mask_token_id) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_ids_are_those_of_sequences_encode(tokenizer, sequence):
    assert tokenizer(sequence)["input_ids"] == encode(sequence).tolist()


def test_rna_and_lowercase_read_as_dna(tokenizer):
    assert (
        tokenizer(SEQUENCES[1])["input_ids"]
        == tokenizer(SEQUENCES[2])["input_ids"]
        == tokenizer(SEQUENCES[0])["input_ids"]
    )
    assert tokenizer("ATGNNNAAG")["input_ids"] == [0, VOCAB["ATG"], 2, VOCAB["AAG"], 1]


def test_padded_batch_pads_right_with_id_3(tokenizer):
    batch = tokenizer(SEQUENCES[:3] + ["ATG"], padding=True)
    width = max(len(encode(s)) for s in SEQUENCES[:3] + ["ATG"])
    for sequence, ids, mask in zip(SEQUENCES[:3] + ["ATG"], batch["input_ids"], batch["attention_mask"]):
        expected = encode(sequence).tolist()
        assert ids == expected + [3] * (width - len(expected))
        assert mask == [1] * len(expected) + [0] * (width - len(expected))


def test_mask_token_written_out_is_one_token(tokenizer):
    assert tokenizer("ATG<MASK>AAA")["input_ids"] == [0, VOCAB["ATG"], 4, VOCAB["AAA"], 1]


def test_decode_joins_the_codons(tokenizer):
    ids = tokenizer(SEQUENCES[0])["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == SEQUENCES[0]
