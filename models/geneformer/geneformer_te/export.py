"""Export Geneformer as a self-contained Hugging Face directory that loads with ``trust_remote_code=True``.

    python -m geneformer_te.export --source /path/to/Geneformer --output-dir geneformer_te_10M
    python -m geneformer_te.export --source /path/to/Geneformer --output-dir out \
        --gene-token-dictionary /path/to/token_dictionary.pkl

``--source`` is a Hugging Face ``BertForMaskedLM`` checkpoint (the published Geneformer models are: a local
directory, or a Hub id where the Hub is reachable). The directory written holds ``config.json`` (with ``auto_map``),
``model.safetensors``, the tokenizer (``gene_tokenizer.py``: ids as text, or the published gene dictionary's Ensembl
ids), the modeling code (``modeling_geneformer_te.py``, ``torch_layers.py``, ``packing.py``, ``meta_init.py``), a
model card and the license, so that

    AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)

works offline, on a CPU without TransformerEngine (``torch`` backend) and on a GPU with it (``te`` backend).
"""

import argparse
import logging
from pathlib import Path

import torch
from transformers import BertForMaskedLM

from .convert import convert_geneformer_hf_to_te
from .gene_tokenizer import build_gene_tokenizer
from .hf_export import write_hf_directory
from .modeling_geneformer_te import NVGeneformerForMaskedLM


logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent

MODEL_CARD = """---
library_name: transformers
license: apache-2.0
tags: [single-cell, geneformer, transformer-engine]
---
# {name}

Geneformer masked-gene model ({num_layers} layers, hidden size {hidden_size}, {num_params:,} parameters) with
NVIDIA TransformerEngine layers and a pure-PyTorch fallback. Each cell is its genes ranked by normalised expression,
as token ids (`<pad>` = 0, `<mask>` = 1).

```python
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}")
batch = tokenizer(["{example}"], return_tensors="pt")
logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
```

`config.backend` is `auto`: TransformerEngine on a CUDA GPU when it is installed, pure PyTorch otherwise (force one
with `from_pretrained(..., backend="torch")` or `backend="te"`). Packed (THD) inputs are accepted through
`cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q` and `max_length_k`.
"""


def save_nv_checkpoint(
    model: NVGeneformerForMaskedLM,
    output_dir: str | Path,
    tokenizer=None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` as a loadable directory, the way every export of this project is written
    (``hf_export.write_hf_directory``: staged then renamed, ``backend: auto``, no FP8/FP4 layers, tied weights once).

    ``tokenizer`` defaults to the id tokenizer of the model's vocabulary size. ``state_dict`` overrides the model's
    own (e.g. a full state dict gathered from FSDP shards on rank 0).
    """
    tokenizer = tokenizer if tokenizer is not None else build_gene_tokenizer(vocab_size=model.config.vocab_size)
    if len(tokenizer) != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model {model.config.vocab_size}")
    example = " ".join(tokenizer.convert_ids_to_tokens(list(range(2, min(7, model.config.vocab_size)))))
    card = MODEL_CARD.format(
        name=Path(output_dir).name,
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        num_params=sum(p.numel() for p in model.parameters()),  # a tied weight counts once
        example=example,
    )
    return write_hf_directory(
        model,
        output_dir,
        state_dict=state_dict,
        tokenizer=tokenizer,
        model_card=card,
        license_file=PACKAGE_DIR / "LICENSE",
    )


def export_hf_checkpoint(
    source: str | Path,
    output_dir: str | Path,
    dtype: torch.dtype | None = None,
    gene_token_dictionary: str | Path | None = None,
    **config_overrides,
) -> Path:
    """Convert a Hugging Face ``BertForMaskedLM`` Geneformer checkpoint into an NVGeneformer export directory."""
    local = Path(source).exists()
    hf_model = BertForMaskedLM.from_pretrained(source, local_files_only=local, dtype=dtype or torch.float32)
    # Convert on the CPU with the torch backend; the saved config says "auto" again.
    nv_model = convert_geneformer_hf_to_te(hf_model, backend="torch", **config_overrides)
    tokenizer = build_gene_tokenizer(gene_token_dictionary, vocab_size=nv_model.config.vocab_size)
    return save_nv_checkpoint(nv_model, output_dir, tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="local BertForMaskedLM (Geneformer) directory or Hub id")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--gene-token-dictionary",
        type=Path,
        help="Geneformer's token_dictionary.pkl (or .json): the tokenizer then reads Ensembl gene ids",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = export_hf_checkpoint(
        args.source,
        args.output_dir,
        dtype=getattr(torch, args.dtype),
        gene_token_dictionary=args.gene_token_dictionary,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
