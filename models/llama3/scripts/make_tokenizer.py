"""Write the nucleotide tokenizer as Hugging Face fast-tokenizer files, so nothing has to be downloaded.

A byte-level character vocabulary of 256 slots: every printable ASCII character is its own token, with its byte
value as id ("A" = 65, "C" = 67, "G" = 71, "T" = 84, "N" = 78, lowercase "a" = 97, ...). So DNA/RNA with any
IUPAC code (RYSWKMBDHVN), soft-masked lowercase repeats and gap characters tokenizes without loss, ids can be
computed straight from bytes in a data pipeline (``np.frombuffer(seq.encode(), np.uint8)``), and 256 rows are
already a multiple of 64 (no vocabulary padding for the embedding GEMM). The control-byte slots 0-4 hold the
special tokens; the other unprintable slots are unused placeholders.

    <pad> = 0, <bos> = 1, <eos> = 2, <unk> = 3, <mask> = 4

Whitespace is dropped; a character outside printable ASCII becomes ``<unk>``. Encoding prepends ``<bos>`` (no
``<eos>``, so that an encoded prompt can be continued by ``generate``); batches pad on the left, as generation
wants. Training collators add ``<eos>`` and choose their own padding.

    python models/llama3/scripts/make_tokenizer.py [--output-dir models/llama3/llama3_te/tokenizer]
"""

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<mask>"]
PRINTABLE = range(33, 127)  # "!" .. "~"; space (32) is whitespace and dropped


def vocabulary() -> list[str]:
    vocab = [f"<unused_{i}>" for i in range(256)]
    vocab[: len(SPECIAL_TOKENS)] = SPECIAL_TOKENS
    for code in PRINTABLE:
        vocab[code] = chr(code)
    return vocab


VOCAB = vocabulary()
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[1] / "llama3_te" / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=131072,
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()
    build_tokenizer().save_pretrained(args.output_dir)
    print(f"wrote the nucleotide tokenizer ({len(VOCAB)} tokens) to {args.output_dir}")


if __name__ == "__main__":
    main()
