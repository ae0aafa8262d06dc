"""The shipped nucleotide tokenizer: byte-value ids, special tokens, padding side, round trip."""

import pytest
from llama_testing import BOS, EOS, PAD, TOKENIZER_DIR
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == len(tokenizer) == 256
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert ids == (PAD, BOS, EOS)
    assert (tokenizer.unk_token_id, tokenizer.mask_token_id) == (3, 4)


@pytest.mark.parametrize("sequence", ["ACGTN", "acgtn", "RYSWKMBDHVN", "ACGU-.*"])
def test_every_printable_character_is_its_byte_value(tokenizer, sequence):
    assert tokenizer(sequence)["input_ids"] == [BOS, *sequence.encode("ascii")]


def test_whitespace_is_dropped_and_non_ascii_is_unknown(tokenizer):
    assert tokenizer("AC GT\nA")["input_ids"] == [BOS, *b"ACGTA"]
    assert tokenizer("AéC")["input_ids"] == [BOS, 65, tokenizer.unk_token_id, 67]


def test_special_token_strings_are_recognised(tokenizer):
    assert tokenizer("AC<mask>G<eos>")["input_ids"] == [BOS, 65, 67, 4, 71, EOS]


def test_batches_pad_on_the_left_for_generation(tokenizer):
    batch = tokenizer(["ACGTACGT", "GAT"], padding=True)
    assert batch["input_ids"][1] == [PAD] * 5 + [BOS, *b"GAT"]
    assert batch["attention_mask"][1] == [0] * 5 + [1] * 4


@pytest.mark.parametrize("sequence", ["ACGTTGCANNNNacgtRYKM", "", "A" * 1000])
def test_decode_round_trip(tokenizer, sequence):
    ids = tokenizer(sequence)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == sequence
    assert tokenizer.decode(ids) == "<bos>" + sequence
