"""Export Encodon as a self-contained Hugging Face directory that loads with ``trust_remote_code=True``, and back.

    python -m codonfm_te.export --source encodon_80m.ckpt --output-dir encodon_80m_te --trust-checkpoint
    python -m codonfm_te.export --source encodon_80m/model.safetensors --output-dir encodon_80m_te
    python -m codonfm_te.export --to-checkpoint --source encodon_80m_te --output-dir encodon_80m_again

``--source`` is a published checkpoint: a Lightning ``.ckpt`` (``state_dict`` + ``hyper_parameters``), a
``.safetensors`` file with ``config.json`` (the hyper_parameters) beside it, or a directory holding both. A .ckpt that
pickles Python objects (the published ones pickle their optimizer settings) is only read with ``--trust-checkpoint``.
The export holds ``config.json`` (with ``auto_map``), ``model.safetensors``, the tokenizer, the modeling code
(``modeling_codonfm_te.py``, ``torch_layers.py``, ``packing.py``, ``meta_init.py``), a model card and the license, so
that ``AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)`` works offline, on a CPU without
TransformerEngine (``torch`` backend) and on a GPU with it (``te`` backend).

``--to-checkpoint`` converts an export (or any NVEncodon checkpoint directory) back to the published layout:
``<output-dir>/model.ckpt``, a Lightning-layout checkpoint (``state_dict`` with ``model.`` keys, ``hyper_parameters``
with EncodonPL's architecture arguments) holding only tensors and plain values, which the published loader
(``EncodonPL(**hyper_parameters).configure_model(state_dict=...)``) reads with ``torch.load``'s default
``weights_only=True``.
"""

import argparse
import logging
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer


try:  # package import (models/codonfm)
    from .convert import convert_encodon_checkpoint_to_te, convert_encodon_te_to_checkpoint, load_encodon_checkpoint
    from .hf_export import write_hf_directory
    from .modeling_codonfm_te import NVEncodonForMaskedLM, NVEncodonPreTrainedModel
except ImportError:  # flat copy inside a recipe folder
    from convert import convert_encodon_checkpoint_to_te, convert_encodon_te_to_checkpoint, load_encodon_checkpoint
    from hf_export import write_hf_directory
    from modeling_codonfm_te import NVEncodonForMaskedLM, NVEncodonPreTrainedModel


logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = PACKAGE_DIR / "tokenizer"

MODEL_CARD = """---
library_name: transformers
license: apache-2.0
tags: [codon, mrna, codonfm, encodon, transformer-engine]
---
# {name}

CodonFM Encodon codon language model ({num_layers} layers, hidden size {hidden_size}, {num_params:,} parameters)
with NVIDIA TransformerEngine layers and a pure-PyTorch fallback.

```python
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}")
batch = tokenizer(["ATGGCCAAGTTTGGATAA", "ATGAAACCC"], return_tensors="pt", padding=True)
logits = model(**batch).logits  # [batch, <CLS> + codons + <SEP>, 69]
```

The tokenizer reads a coding sequence (DNA or RNA, any case, whitespace ignored) as in-frame codons: `<CLS>`, one
token per codon, `<SEP>`; a codon with a base other than A/C/G/T/U and a trailing partial codon read as `<UNK>`.
`AutoModelForSequenceClassification.from_pretrained("{name}", trust_remote_code=True, num_labels=...)` adds a
sequence-level head (mean of the last hidden state over each sequence's tokens).

`config.backend` is `auto`: TransformerEngine on a CUDA GPU when it is installed, pure PyTorch otherwise (force one
with `from_pretrained(..., backend="torch")` or `backend="te"`). Both give the same results within floating-point
precision. Packed (THD) inputs are accepted through `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q` and
`max_length_k`. config.json says `model_type: bert` only so that the tokenizer loads without custom code: the model is
Encodon (`architectures`), and it loads only with `trust_remote_code=True`.
"""


def save_nv_checkpoint(
    model: NVEncodonPreTrainedModel,
    output_dir: str | Path,
    tokenizer_dir: str | Path = TOKENIZER_DIR,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` as a loadable directory, the way every export of this project is written
    (``hf_export.write_hf_directory``: staged then renamed, ``backend: auto``, no FP8/FP4 layers).

    ``state_dict`` overrides the model's own (e.g. a full state dict gathered from FSDP shards on rank 0).
    """
    card = MODEL_CARD.format(
        name=Path(output_dir).name,
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        num_params=sum(p.numel() for p in model.parameters()),
    )
    return write_hf_directory(
        model,
        output_dir,
        state_dict=state_dict,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        model_card=card,
        license_file=PACKAGE_DIR / "LICENSE",
    )


def export_hf_checkpoint(
    source: str | Path,
    output_dir: str | Path,
    dtype: torch.dtype | None = None,
    trust_checkpoint: bool = False,
    **config_overrides,
) -> Path:
    """Convert a published Encodon checkpoint (``.ckpt``, ``.safetensors`` + config.json, or a directory of both)
    into an NVEncodon export directory."""
    state_dict, hparams = load_encodon_checkpoint(source, trust_checkpoint=trust_checkpoint)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    # Convert on the CPU with the torch backend; the saved config says "auto" again.
    nv_model = convert_encodon_checkpoint_to_te(state_dict, hparams, backend="torch", **config_overrides)
    return save_nv_checkpoint(nv_model, output_dir)


def export_published_checkpoint(source: str | Path | NVEncodonForMaskedLM, output_dir: str | Path) -> Path:
    """Write an NVEncodon model (or export directory) as ``<output_dir>/model.ckpt`` in the published Lightning layout
    (see the module docstring). The file is written beside its name and renamed once complete."""
    model = source
    if not isinstance(source, NVEncodonForMaskedLM):
        model = NVEncodonForMaskedLM.from_pretrained(source, backend="torch")
    state_dict, hparams = convert_encodon_te_to_checkpoint(model)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path, partial = output_dir / "model.ckpt", output_dir / ".model.ckpt.partial"
    torch.save({"state_dict": state_dict, "hyper_parameters": hparams}, partial)
    os.replace(partial, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source",
        required=True,
        help="published Encodon checkpoint: .ckpt, .safetensors (config.json beside it) or a directory of both "
        "(with --to-checkpoint: an NVEncodon export)",
    )
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read a .ckpt that pickles Python objects (runs code from the file: only for checkpoints you trust)",
    )
    parser.add_argument(
        "--to-checkpoint",
        action="store_true",
        help="convert an NVEncodon export back to a published Lightning-layout <output-dir>/model.ckpt",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.to_checkpoint:
            path = export_published_checkpoint(args.source, args.output_dir)
        else:
            path = export_hf_checkpoint(
                args.source, args.output_dir, dtype=getattr(torch, args.dtype), trust_checkpoint=args.trust_checkpoint
            )
    except (FileNotFoundError, ValueError) as error:  # a wrong path or checkpoint: one line, not a traceback
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
