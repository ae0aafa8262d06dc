"""Write the Encodon codon tokenizer as Hugging Face fast-tokenizer files (``codonfm_te/tokenizer/``).

    python models/codonfm/scripts/make_tokenizer.py [--output-dir models/codonfm/codonfm_te/tokenizer]

The vocabulary is ``codonfm_te.sequences.VOCAB`` (the published 69 tokens: <CLS> <SEP> <UNK> <PAD> <MASK>, then the 64
codons in ``itertools.product("ACGT", repeat=3)`` order), and the rule is ``sequences.encode``'s:

- normalizer: whitespace removed, lowercase bases read as uppercase, RNA ``U`` read as ``T``;
- pre-tokenizer: the sequence cut into in-frame chunks of 3 characters from its first one, so position ``i`` is always
  codon ``i // 3`` (a trailing chunk of 1 or 2 bases stays a chunk of its own);
- model: word-level over the vocabulary; a chunk that is not a codon (a partial codon, or one with a character other
  than A/C/G/T such as ``N``) is ``<UNK>``;
- post-processor: ``<CLS> $A <SEP>``; padding with ``<PAD>`` (id 3) on the right; ``<MASK>`` written out is one token.
"""

import argparse
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from codonfm_te.sequences import SPECIAL_TOKENS, VOCAB


MAX_LENGTH = 2048  # the published models' max_position_embeddings (tokens, <CLS> and <SEP> included)
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[1] / "codonfm_te" / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    cls, sep, unk, pad, mask = SPECIAL_TOKENS
    tokenizer = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=unk))
    # No Uppercase normalizer exists; only the bases need it (any other lowercase letter makes an <UNK> codon anyway).
    case_and_rna = [normalizers.Replace(lower, lower.upper()) for lower in "acgt"]
    case_and_rna += [normalizers.Replace("u", "T"), normalizers.Replace("U", "T")]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace(Regex(r"\s+"), ""), *case_and_rna])
    # Leftmost-first matches of 1 to 3 characters: "ACGTA" -> "ACG", "TA". Special tokens are added tokens, matched
    # before this runs, so a written-out "<MASK>" stays one token.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(".{1,3}"), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, VOCAB[cls]), (sep, VOCAB[sep])],
    )
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        cls_token=cls,
        sep_token=sep,
        unk_token=unk,
        pad_token=pad,
        mask_token=mask,
        model_max_length=MAX_LENGTH,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()
    build_tokenizer().save_pretrained(args.output_dir)
    print(f"wrote the Encodon tokenizer ({len(VOCAB)} tokens) to {args.output_dir}")


if __name__ == "__main__":
    main()
