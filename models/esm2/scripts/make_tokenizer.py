"""Write the ESM-2 tokenizer as Hugging Face fast-tokenizer files, so nothing has to be downloaded.

The vocabulary is ESM-2's 33 tokens in ESM's order. The tokenizer reproduces ``transformers.EsmTokenizer``:
every vocabulary entry is split out on its own, whitespace is dropped, any run of characters that is not a
vocabulary entry becomes a single ``<unk>``, and sequences are wrapped as ``<cls> ... <eos>``.

    python models/esm2/scripts/make_tokenizer.py [--output-dir models/esm2/esm2_te/tokenizer]
"""

import argparse
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


SPECIAL_TOKENS = ["<cls>", "<pad>", "<eos>", "<unk>"]
RESIDUES = list("LAGVSERTIDPKQNFYMHWCXBUZO.-")
VOCAB = [*SPECIAL_TOKENS, *RESIDUES, "<null_1>", "<mask>"]
assert len(VOCAB) == 33

DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[1] / "esm2_te" / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Multi-character tokens first so that "<mask>" is not read as "<", "m", ...
    token_pattern = "|".join(re.escape(t) for t in sorted(VOCAB, key=len, reverse=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(token_pattern), behavior="isolated"),
        ]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<cls> $A <eos>",
        pair="<cls> $A <eos> $B:1 <eos>:1",
        special_tokens=[("<cls>", vocab["<cls>"]), ("<eos>", vocab["<eos>"])],
    )
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        cls_token="<cls>",
        pad_token="<pad>",
        mask_token="<mask>",
        eos_token="<eos>",
        model_max_length=1026,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()
    build_tokenizer().save_pretrained(args.output_dir)
    print(f"wrote the ESM-2 tokenizer ({len(VOCAB)} tokens) to {args.output_dir}")


if __name__ == "__main__":
    main()
