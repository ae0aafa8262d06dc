"""Export a ViT as a self-contained Hugging Face directory that loads with ``trust_remote_code=True``.

    python -m vit_te.export --source google/vit-base-patch16-224 --output-dir vit_base_te
    python -m vit_te.export --source /path/to/local/hf/vit --output-dir out

The directory holds ``config.json`` (with ``auto_map``), ``model.safetensors``, ``preprocessor_config.json`` (a
``ViTImageProcessor``: resize to the model's image size, scale to [0, 1], normalise), the modeling code
(``modeling_vit_te.py``, ``torch_layers.py``, ``packing.py``, ``meta_init.py``), a model card and the license, so that

    AutoModelForImageClassification.from_pretrained(out, trust_remote_code=True)

works offline, on a CPU without TransformerEngine (``torch`` backend) and on a GPU with it (``te`` backend).
"""

import argparse
import logging
from pathlib import Path

import torch
from transformers import ViTForImageClassification, ViTImageProcessor

from .convert import convert_vit_hf_to_te
from .hf_export import write_hf_directory
from .modeling_vit_te import NVViTForImageClassification


logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
# Hugging Face ViT's normalisation (the published ViT checkpoints were trained with inputs in [-1, 1]).
DEFAULT_IMAGE_MEAN = (0.5, 0.5, 0.5)
DEFAULT_IMAGE_STD = (0.5, 0.5, 0.5)

MODEL_CARD = """---
library_name: transformers
license: apache-2.0
tags: [vision, image-classification, vit, transformer-engine]
pipeline_tag: image-classification
---
# {name}

Vision Transformer ({num_layers} layers, hidden size {hidden_size}, patch {patch_size}, {image_size}x{image_size}
pixels, {num_labels} classes, {num_params:,} parameters) with NVIDIA TransformerEngine layers and a pure-PyTorch
fallback.

```python
from PIL import Image
from transformers import AutoModelForImageClassification, ViTImageProcessor

model = AutoModelForImageClassification.from_pretrained("{name}", trust_remote_code=True)
processor = ViTImageProcessor.from_pretrained("{name}")
logits = model(**processor(Image.open("cat.png"), return_tensors="pt")).logits
print(model.config.id2label[int(logits.argmax())])
```

`config.backend` is `auto`: TransformerEngine on a CUDA GPU when it is installed, pure PyTorch otherwise (force one
with `from_pretrained(..., backend="torch")` or `backend="te"`). Both give the same results within floating-point
precision.
"""


def image_processor_for(config, mean=DEFAULT_IMAGE_MEAN, std=DEFAULT_IMAGE_STD) -> ViTImageProcessor:
    """The preprocessing a model of ``config`` expects: resize to its image size, scale to [0, 1], normalise."""
    height, width = config.image_size if isinstance(config.image_size, list | tuple) else (config.image_size,) * 2
    return ViTImageProcessor(
        do_resize=True,
        size={"height": height, "width": width},
        do_rescale=True,
        do_normalize=True,
        image_mean=list(mean),
        image_std=list(std),
    )


def save_nv_checkpoint(
    model: NVViTForImageClassification,
    output_dir: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    image_processor: ViTImageProcessor | None = None,
) -> Path:
    """Write ``model`` as a loadable directory, the way every export of this project is written
    (``hf_export.write_hf_directory``: staged then renamed, ``backend: auto``, no FP8/FP4 layers).

    ``state_dict`` overrides the model's own (e.g. a full state dict gathered from FSDP shards on rank 0);
    ``image_processor`` defaults to :func:`image_processor_for` the model's config.
    """
    config = model.config
    card = MODEL_CARD.format(
        name=Path(output_dir).name,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        patch_size=config.patch_size,
        image_size=config.image_size,
        num_labels=config.num_labels,
        num_params=sum(p.numel() for p in model.parameters()),
    )
    return write_hf_directory(
        model,
        output_dir,
        state_dict=state_dict,
        tokenizer=image_processor or image_processor_for(config),
        model_card=card,
        license_file=PACKAGE_DIR / "LICENSE",
    )


def export_hf_checkpoint(
    source: str | Path, output_dir: str | Path, dtype: torch.dtype | None = None, **config_overrides
) -> Path:
    """Convert a Hugging Face ``ViTForImageClassification`` checkpoint (local directory or Hub id) into an NVViT
    export directory; the source's ``preprocessor_config.json`` is kept when it has one."""
    local = Path(source).exists()
    hf_model = ViTForImageClassification.from_pretrained(source, local_files_only=local, dtype=dtype or torch.float32)
    # Convert on the CPU with the torch backend; the saved config says "auto" again.
    nv_model = convert_vit_hf_to_te(hf_model, backend="torch", **config_overrides)
    processor = None
    if not local or (Path(source) / "preprocessor_config.json").is_file():
        processor = ViTImageProcessor.from_pretrained(source, local_files_only=local)
    return save_nv_checkpoint(nv_model, output_dir, image_processor=processor)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="local Hugging Face ViT directory or Hub id")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = export_hf_checkpoint(args.source, args.output_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
