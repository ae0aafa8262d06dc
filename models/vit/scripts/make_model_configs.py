"""Write the ViT shapes as local ``config.json`` files, so recipes and tests need no Hub access.

    python models/vit/scripts/make_model_configs.py [--output-dir models/vit/model_configs]

ViT-Tiny, -Small and -Base at 224 pixels with 16-pixel patches are the shapes of Dosovitskiy et al. (2021) and Touvron
et al. (2021, DeiT); ``vit-l0-tiny`` is a 32-pixel toy for tests and the CPU sanity run. The number of classes is
ImageNet's 1,000 (4 for the toy); a recipe sets it from its data.
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vit_te.modeling_vit_te import AUTO_MAP, NVViTConfig


# name: (layers, hidden, heads, mlp, image size, patch size, classes)
VIT_SHAPES = {
    "vit-tiny-patch16-224": (12, 192, 3, 768, 224, 16, 1000),
    "vit-small-patch16-224": (12, 384, 6, 1536, 224, 16, 1000),
    "vit-base-patch16-224": (12, 768, 12, 3072, 224, 16, 1000),
    "vit-l0-tiny": (4, 64, 4, 256, 32, 4, 4),
}


def vit_config(
    layers: int, hidden: int, heads: int, mlp: int, image_size: int, patch_size: int, classes: int
) -> NVViTConfig:
    config = NVViTConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=mlp,
        image_size=image_size,
        patch_size=patch_size,
        num_labels=classes,
        backend="auto",
    )
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["NVViTForImageClassification"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "model_configs")
    args = parser.parse_args()
    for name, shape in VIT_SHAPES.items():
        vit_config(*shape).save_pretrained(args.output_dir / name)
        print(f"wrote {args.output_dir / name / 'config.json'}")


if __name__ == "__main__":
    main()
