# Copied from models/geneformer/geneformer_te/gene_tokenizer.py — edit the source, then run ci/check_copies.py --fix
"""Geneformer's tokenizer: a cell is a list of gene tokens (its genes ranked by normalised expression), so the
model reads pre-tokenized ids and the tokenizer only has to name them.

Two vocabularies:

* the default one, when no gene dictionary is given: ``<pad>`` = 0, ``<mask>`` = 1 and every other id written as
  its decimal number (``"2"`` ... ``"25425"``), so ``tokenizer("17 523 9")["input_ids"] == [17, 523, 9]``. It is
  built in code from the vocabulary size, so nothing large is shipped.
* the published gene token dictionary (Geneformer's ``token_dictionary.pkl``: Ensembl gene id -> token id, with
  ``<pad>`` and ``<mask>``), when a user has it: ``tokenizer("ENSG00000141510 ENSG00000146648")`` then gives the
  ids the published models were trained with. Pickle or JSON files are accepted.

Either way it is a plain ``tokenizers`` WordLevel tokenizer (whitespace-separated tokens, no special tokens added),
saved as ``tokenizer.json`` and loaded with ``AutoTokenizer.from_pretrained(dir)`` without custom code. An unknown
token is an error, never a silent ``<unk>``: a gene the model has no embedding for must not pass unnoticed.
"""

import json
import pickle
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


PAD_TOKEN, PAD_TOKEN_ID = "<pad>", 0
MASK_TOKEN, MASK_TOKEN_ID = "<mask>", 1
DEFAULT_VOCAB_SIZE = 25_426  # Geneformer V1 (Genecorpus-30M): <pad>, <mask> and 25,424 genes
MODEL_MAX_LENGTH = 2048


def id_vocabulary(vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[str, int]:
    """``<pad>`` = 0, ``<mask>`` = 1, then each gene token named by its id: ``{"2": 2, ..., str(n - 1): n - 1}``."""
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be at least 3 (<pad>, <mask> and one gene), got {vocab_size}")
    return {PAD_TOKEN: PAD_TOKEN_ID, MASK_TOKEN: MASK_TOKEN_ID, **{str(i): i for i in range(2, vocab_size)}}


def load_gene_token_dictionary(path: str | Path) -> dict[str, int]:
    """Read a gene token dictionary (pickle or JSON: token -> id) and check that the model can use it as is."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"gene token dictionary {path} does not exist")
    raw = path.read_bytes()
    try:  # Geneformer publishes its dictionary as a pickle; unpickling runs code, so load only files you trust
        vocabulary = json.loads(raw) if path.suffix == ".json" else pickle.loads(raw)
    except Exception as error:
        raise ValueError(f"{path} is not a pickled or JSON gene token dictionary: {error}") from None
    if not isinstance(vocabulary, dict) or not vocabulary:
        raise ValueError(f"{path} must hold a non-empty mapping of token -> id, got {type(vocabulary).__name__}")
    check_vocabulary(vocabulary, str(path))
    return {str(token): int(index) for token, index in vocabulary.items()}


def check_vocabulary(vocabulary: dict, source: str = "the vocabulary") -> None:
    """Ids must be 0..n-1 without gaps or repeats, with ``<pad>`` = 0 and ``<mask>`` = 1 (the model's ids)."""
    ids = sorted(int(index) for index in vocabulary.values())
    if ids != list(range(len(ids))):
        repeated = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(
            f"{source}: token ids must be 0..{len(ids) - 1} with no gaps or repeats"
            + (f" (repeated: {repeated})" if repeated else "")
        )
    for token, wanted in ((PAD_TOKEN, PAD_TOKEN_ID), (MASK_TOKEN, MASK_TOKEN_ID)):
        if vocabulary.get(token) != wanted:
            raise ValueError(f"{source}: {token} must have id {wanted}, got {vocabulary.get(token)!r}")


def build_gene_tokenizer(
    token_dictionary: str | Path | dict[str, int] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """The tokenizer of a gene dictionary (a file or a mapping), or of the default id vocabulary of ``vocab_size``."""
    if token_dictionary is None:
        vocabulary = id_vocabulary(vocab_size)
    elif isinstance(token_dictionary, dict):
        check_vocabulary(token_dictionary)
        vocabulary = {str(token): int(index) for token, index in token_dictionary.items()}
    else:
        vocabulary = load_gene_token_dictionary(token_dictionary)
    backend = Tokenizer(models.WordLevel(vocab=vocabulary))  # no unk token: an unknown gene is an error
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Every <...> entry (published dictionaries of later versions add <cls> and <eos>) is a special token.
    specials = sorted((t for t in vocabulary if t.startswith("<") and t.endswith(">")), key=vocabulary.get)
    extra = [t for t in specials if t not in (PAD_TOKEN, MASK_TOKEN)]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=extra or None,
        model_max_length=MODEL_MAX_LENGTH,
        model_input_names=["input_ids", "attention_mask"],
    )
