"""The shipped fast tokenizer against Hugging Face's reference EsmTokenizer."""

import pytest
from esm_testing import TOKENIZER_DIR
from transformers import AutoTokenizer, EsmTokenizer


SEQUENCES = [
    "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSPLHSVYVDQWDWERVMGDGERQFSTLKSTVEAIWAGIKATEAAVSEEFGLAPFLPDQIHFVHSQELLSRYPDLDAKGRERAIAKDLGAVFLVGIGGKLSDGHRHDVRAPDYDDWUAWNGKGDKKAKK",
    "ACDEFGHIKLMNPQRSTVWY",
    "XBZUO.-",
    "MKJJTA",  # J is not a residue: a run of unknown characters is one <unk>
    "mktay",  # lowercase is not in the vocabulary
    "MK TA\tY",  # whitespace is dropped
    "MA<mask>KL<mask><mask>Q",
    "<cls>MK<eos>",
    "",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    fast = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    vocab_file = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab_file.write_text("\n".join(fast.convert_ids_to_tokens(list(range(fast.vocab_size)))))
    return fast, EsmTokenizer(str(vocab_file))


def test_vocabulary_is_esm2(tokenizers):
    fast, _ = tokenizers
    assert fast.vocab_size == 33
    assert (fast.cls_token_id, fast.pad_token_id, fast.eos_token_id, fast.unk_token_id, fast.mask_token_id) == (
        0,
        1,
        2,
        3,
        32,
    )
    assert fast.convert_tokens_to_ids(list("LAGVSERTIDPKQNFYMHWCXBUZO.-")) == list(range(4, 31))


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_single_sequences_match_reference(tokenizers, sequence):
    fast, reference = tokenizers
    assert fast(sequence)["input_ids"] == reference(sequence)["input_ids"]


def test_padded_batch_matches_reference(tokenizers):
    fast, reference = tokenizers
    expected = reference(SEQUENCES[:4], padding=True)
    actual = fast(SEQUENCES[:4], padding=True)
    assert actual["input_ids"] == expected["input_ids"]
    assert actual["attention_mask"] == expected["attention_mask"]


def test_pairs_match_reference(tokenizers):
    fast, reference = tokenizers
    assert fast("MKT", "AYI")["input_ids"] == reference("MKT", "AYI")["input_ids"]


def test_decode_round_trip(tokenizers):
    fast, _ = tokenizers
    ids = fast(SEQUENCES[1])["input_ids"]
    assert fast.decode(ids, skip_special_tokens=True) == SEQUENCES[1]
