"""Export ESM-2 as a self-contained Hugging Face directory that loads with ``trust_remote_code=True``.

    python -m esm2_te.export --source facebook/esm2_t33_650M_UR50D --output-dir esm2_650M_te
    python -m esm2_te.export --source /path/to/local/hf/esm2 --output-dir out

The directory holds ``config.json`` (with ``auto_map``), ``model.safetensors``, the tokenizer, the modeling code
(``modeling_esm_te.py``, ``torch_layers.py``, ``packing.py``, ``meta_init.py``), a model card and the license, so that

    AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)

works offline, on a CPU without TransformerEngine (``torch`` backend) and on a GPU with it (``te`` backend).
"""

import argparse
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, EsmForMaskedLM

from .convert import convert_esm_hf_to_te
from .hf_export import write_hf_directory
from .modeling_esm_te import NVEsmForMaskedLM


logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = PACKAGE_DIR / "tokenizer"

MODEL_CARD = """---
library_name: transformers
license: apache-2.0
tags: [protein, esm2, transformer-engine]
---
# {name}

ESM-2 masked protein language model ({num_layers} layers, hidden size {hidden_size}, {num_params:,} parameters)
with NVIDIA TransformerEngine layers and a pure-PyTorch fallback.

```python
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ"], return_tensors="pt")
logits = model(**batch).logits
```

`config.backend` is `auto`: TransformerEngine on a CUDA GPU when it is installed, pure PyTorch otherwise (force one
with `from_pretrained(..., backend="torch")` or `backend="te"`). Both give the same results within floating-point
precision. Packed (THD) inputs are accepted through `cu_seq_lens_q`,
`cu_seq_lens_k`, `max_length_q` and `max_length_k`.
"""


def save_nv_checkpoint(
    model: NVEsmForMaskedLM,
    output_dir: str | Path,
    tokenizer_dir: str | Path = TOKENIZER_DIR,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` as a loadable directory, the way every export of this project is written
    (``hf_export.write_hf_directory``: staged then renamed, ``backend: auto``, no FP8/FP4 layers, tied weights once).

    ``state_dict`` overrides the model's own (e.g. a full state dict gathered from FSDP shards on rank 0).
    """
    card = MODEL_CARD.format(
        name=Path(output_dir).name,
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        num_params=sum(p.numel() for p in model.parameters()),  # a tied weight counts once
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
    """Convert a Hugging Face ESM-2 checkpoint (local directory or Hub id) into an NVEsm export directory."""
    local = Path(source).exists()
    hf_model = EsmForMaskedLM.from_pretrained(source, local_files_only=local, dtype=dtype or torch.float32)
    # Convert on the CPU with the torch backend; the saved config says "auto" again.
    nv_model = convert_esm_hf_to_te(hf_model, backend="torch", **config_overrides)
    return save_nv_checkpoint(nv_model, output_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="local Hugging Face ESM-2 directory or Hub id")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = export_hf_checkpoint(args.source, args.output_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
