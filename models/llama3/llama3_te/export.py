"""Export Llama 3 as a self-contained Hugging Face directory that loads with ``trust_remote_code=True``.

    python -m llama3_te.export --source /path/to/local/hf/llama --output-dir llama3_te_out

The directory holds ``config.json`` (with ``auto_map``), ``model.safetensors``, the tokenizer, the modeling code
(``modeling_llama_te.py``, ``torch_layers.py``, ``packing.py``, ``meta_init.py``), a model card and the license, so that

    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)

works offline, on a CPU without TransformerEngine (``torch`` backend) and on a GPU with it (``te`` backend).
The tokenizer is the nucleotide tokenizer shipped with this package unless ``tokenizer_dir`` names another.
"""

import argparse
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from .convert import convert_llama_hf_to_te
from .hf_export import write_hf_directory
from .modeling_llama_te import NVLlamaForCausalLM


logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = PACKAGE_DIR / "tokenizer"

MODEL_CARD = """---
library_name: transformers
license: apache-2.0
tags: [dna, llama3, causal-lm, transformer-engine]
---
# {name}

Llama 3 causal language model ({num_layers} layers, hidden size {hidden_size}, {num_params:,} parameters)
with NVIDIA TransformerEngine layers and a pure-PyTorch fallback.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}")
batch = tokenizer(["ACGTACGTTAGC", "GATTACA"], return_tensors="pt", padding=True)  # left padding
generated = model.generate(**batch, max_new_tokens=20, do_sample=False)
```

`config.backend` is `auto`: TransformerEngine on a CUDA GPU when it is installed, pure PyTorch otherwise (force one
with `from_pretrained(..., backend="torch")` or `backend="te"`). Both give the same results within floating-point
precision. Packed (THD) inputs are accepted through `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q` and
`max_length_k`. `generate` uses a key/value cache on the torch backend; on the TE backend it recomputes the prefix
at every step (correct, slower).
"""


def save_nv_checkpoint(
    model: NVLlamaForCausalLM,
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
    source: str | Path,
    output_dir: str | Path,
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | Path = TOKENIZER_DIR,
    **config_overrides,
) -> Path:
    """Convert a Hugging Face Llama checkpoint (local directory or Hub id) into an NVLlama export directory."""
    local = Path(source).exists()
    hf_model = LlamaForCausalLM.from_pretrained(source, local_files_only=local, dtype=dtype or torch.float32)
    # Convert on the CPU with the torch backend; the saved config says "auto" again.
    nv_model = convert_llama_hf_to_te(hf_model, backend="torch", **config_overrides)
    return save_nv_checkpoint(nv_model, output_dir, tokenizer_dir=tokenizer_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="local Hugging Face Llama directory or Hub id")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR, help="default: the nucleotide tokenizer")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = export_hf_checkpoint(
        args.source, args.output_dir, dtype=getattr(torch, args.dtype), tokenizer_dir=args.tokenizer_dir
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
