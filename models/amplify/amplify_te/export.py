"""Export AMPLIFY as a self-contained Hugging Face directory that loads with ``trust_remote_code=True``, and back.

    python -m amplify_te.export --source /path/to/AMPLIFY_120M --output-dir amplify_120M_te
    python -m amplify_te.export --source chandar-lab/AMPLIFY_120M --output-dir amplify_120M_te   # needs the Hub
    python -m amplify_te.export --to-published --source amplify_120M_te --output-dir AMPLIFY_120M_again

``--source`` is a published checkpoint: a directory with config.json and model.safetensors (or pytorch_model.bin), or
a Hub id. The export holds ``config.json`` (with ``auto_map``), ``model.safetensors``, the tokenizer, the modeling code
(``modeling_amplify_te.py``, ``torch_layers.py``, ``packing.py``, ``meta_init.py``), a model card and the license, so that

    AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)

works offline, on a CPU without TransformerEngine (``torch`` backend) and on a GPU with it (``te`` backend).
``--to-published`` converts an export (or any NVAmplify checkpoint directory) back to the published layout: config.json
and model.safetensors as the published checkpoints have them, plus the tokenizer.
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from .convert import convert_amplify_hf_to_te, convert_amplify_te_to_hf, load_published_checkpoint
from .hf_export import write_hf_directory
from .modeling_amplify_te import NVAmplifyForMaskedLM


logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = PACKAGE_DIR / "tokenizer"

MODEL_CARD = """---
library_name: transformers
license: apache-2.0
tags: [protein, amplify, transformer-engine]
---
# {name}

AMPLIFY masked protein language model ({num_layers} layers, hidden size {hidden_size}, {num_params:,} parameters)
with NVIDIA TransformerEngine layers and a pure-PyTorch fallback.

```python
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}")
batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ"], return_tensors="pt")
logits = model(**batch).logits
```

`config.backend` is `auto`: TransformerEngine on a CUDA GPU when it is installed, pure PyTorch otherwise (force one
with `from_pretrained(..., backend="torch")` or `backend="te"`). Both give the same results within floating-point
precision. Packed (THD) inputs are accepted through `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q` and
`max_length_k`. config.json says `model_type: esm` only so that the tokenizer loads without custom code: the model is
AMPLIFY (`architectures`), and it loads only with `trust_remote_code=True`.
"""


def save_nv_checkpoint(
    model: NVAmplifyForMaskedLM,
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
    source: str | Path, output_dir: str | Path, dtype: torch.dtype | None = None, **config_overrides
) -> Path:
    """Convert a published AMPLIFY checkpoint (local directory or Hub id) into an NVAmplify export directory."""
    state_dict, config = load_published_checkpoint(source)
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    # Convert on the CPU with the torch backend; the saved config says "auto" again.
    nv_model = convert_amplify_hf_to_te(state_dict, config, backend="torch", **config_overrides)
    return save_nv_checkpoint(nv_model, output_dir)


def export_published_checkpoint(
    source: str | Path | NVAmplifyForMaskedLM, output_dir: str | Path, tokenizer_dir: str | Path = TOKENIZER_DIR
) -> Path:
    """Write an NVAmplify model (or checkpoint directory) in the published layout: config.json, model.safetensors
    and the tokenizer. Load it with the published code (the checkpoints' ``amplify.py``) or convert it again."""
    model = source
    if not isinstance(source, NVAmplifyForMaskedLM):
        model = NVAmplifyForMaskedLM.from_pretrained(source, backend="torch")
    state_dict, config = convert_amplify_te_to_hf(model)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, output_dir / "model.safetensors", metadata={"format": "pt"})
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source", required=True, help="published AMPLIFY directory or Hub id (or, with --to-published, an export)"
    )
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--to-published", action="store_true", help="convert an NVAmplify export back to the published layout"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.to_published:
        path = export_published_checkpoint(args.source, args.output_dir)
    else:
        path = export_hf_checkpoint(args.source, args.output_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
