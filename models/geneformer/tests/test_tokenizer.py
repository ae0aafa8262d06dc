"""The gene tokenizer: the default id vocabulary, a published-style gene dictionary (pickle or JSON), and the errors
for a dictionary the model cannot use. Expected ids are written out by hand."""

import json
import pickle

import pytest
from transformers import AutoTokenizer

from geneformer_te.gene_tokenizer import DEFAULT_VOCAB_SIZE, build_gene_tokenizer, load_gene_token_dictionary


def test_default_vocabulary_reads_ids_written_as_text():
    tokenizer = build_gene_tokenizer()
    assert len(tokenizer) == DEFAULT_VOCAB_SIZE == 25_426
    assert (tokenizer.pad_token_id, tokenizer.mask_token_id) == (0, 1)
    assert tokenizer("17 523 9 25425")["input_ids"] == [17, 523, 9, 25425]  # no special tokens added
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<mask>", "2"]
    batch = tokenizer(["4 5 6", "7"], padding=True)
    assert batch["input_ids"] == [[4, 5, 6], [7, 0, 0]] and batch["attention_mask"] == [[1, 1, 1], [1, 0, 0]]


def test_an_unknown_gene_is_an_error_not_unk():
    with pytest.raises(Exception, match="UNK"):
        build_gene_tokenizer(vocab_size=10)("3 10")


GENES = {"<pad>": 0, "<mask>": 1, "ENSG00000141510": 2, "ENSG00000146648": 3, "ENSG00000012048": 4}


@pytest.mark.parametrize("suffix", [".pkl", ".json"])
def test_published_style_gene_dictionary(tmp_path, suffix):
    path = tmp_path / f"token_dictionary{suffix}"
    path.write_bytes(pickle.dumps(GENES) if suffix == ".pkl" else json.dumps(GENES).encode())
    tokenizer = build_gene_tokenizer(path)
    assert tokenizer("ENSG00000012048 ENSG00000141510 <mask>")["input_ids"] == [4, 2, 1]
    tokenizer.save_pretrained(tmp_path / "saved")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")  # plain tokenizers, no custom code
    assert reloaded("ENSG00000146648")["input_ids"] == [3] and reloaded.pad_token_id == 0


def test_later_versions_special_tokens_are_special(tmp_path):
    tokenizer = build_gene_tokenizer({**GENES, "<cls>": 5, "<eos>": 6})
    assert set(tokenizer.all_special_ids) == {0, 1, 5, 6}


@pytest.mark.parametrize(
    ("vocabulary", "message"),
    [
        ({"<pad>": 0, "<mask>": 1, "A": 3}, "no gaps or repeats"),
        ({"<pad>": 0, "<mask>": 1, "A": 1}, r"repeated: \[1\]"),
        ({"<pad>": 1, "<mask>": 0, "A": 2}, "<pad> must have id 0"),
        ({"<pad>": 0, "A": 1, "B": 2}, "<mask> must have id 1"),
    ],
)
def test_unusable_dictionaries_are_named(tmp_path, vocabulary, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(vocabulary))
    with pytest.raises(ValueError, match=message):
        load_gene_token_dictionary(path)


def test_unreadable_or_missing_dictionary(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gene_token_dictionary(tmp_path / "nope.pkl")
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a pickled or JSON gene token dictionary"):
        load_gene_token_dictionary(tmp_path / "junk.pkl")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="non-empty mapping"):
        load_gene_token_dictionary(tmp_path / "list.json")
