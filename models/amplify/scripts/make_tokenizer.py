"""Write the AMPLIFY tokenizer as Hugging Face fast-tokenizer files, so nothing has to be downloaded.

The vocabulary is the 27 tokens of the published AMPLIFY checkpoints (chandar-lab/AMPLIFY_120M and AMPLIFY_350M on
the Hugging Face Hub) in their published order: five special tokens, the chain separator ``|``, the 20 standard
residues in ESM's frequency order, and ``B``. Source: the checkpoints' ``tokenizer.json``, as vendored in the public
repository oneclickbio/biomodel-base at ``src/models/amplify/tokenizer.json``; the training code's longer vocabulary
(chandar-lab/AMPLIFY, ``conf/tokenizer/amplify_vocab.txt``, 32 tokens) was cut to these 27 for the release.

The tokenizer behaves as the published one: every character is a token on its own, a character that is not in the
vocabulary (lowercase letters, ``X``, ``J``, whitespace, ...) becomes ``<unk>``, the special tokens are recognised
where they are written out (``<mask>``), and a sequence is wrapped as ``<bos> residues <eos>``. Decoding joins the
residues without spaces.

    python models/amplify/scripts/make_tokenizer.py [--output-dir models/amplify/amplify_te/tokenizer]
"""

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


SPECIAL_TOKENS = ["<pad>", "<unk>", "<mask>", "<bos>", "<eos>"]
VOCAB = [*SPECIAL_TOKENS, "|", *"LAGVSERTIDPKQNFYMHWC", "B"]
assert len(VOCAB) == 27 and len(set(VOCAB)) == 27

MAX_LENGTH = 2048  # the published models' max_length (rotary table size)
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[1] / "amplify_te" / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Splitting on the empty pattern cuts the text into single characters (the published pre-tokenizer). Special
    # tokens are added tokens, matched before this runs, so "<mask>" stays one token.
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="removed")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>",
        pair="$A $B:1",  # as published: a pair is concatenated without special tokens
        special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])],
    )
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=MAX_LENGTH,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()
    build_tokenizer().save_pretrained(args.output_dir)
    print(f"wrote the AMPLIFY tokenizer ({len(VOCAB)} tokens) to {args.output_dir}")


if __name__ == "__main__":
    main()
