"""Write the published Encodon shapes as local ``config.json`` files, so recipes need no Hub access.

    python models/codonfm/scripts/make_model_configs.py [--output-dir models/codonfm/model_configs]

Source of the shapes: CodonFM's ``src/config.py`` (``MODEL_ARCHITECTURES``: encodon_80m, encodon_600m, encodon_1b;
NVIDIA, 2025), as read in the public GitHub repository ziyuanding/CodonFM. Every other field
keeps EncodonPL's default, which every published model uses: vocabulary 69, GELU, dropout 0.1 (hidden and attention),
LayerNorm eps 1e-12, initializer_range 0.02 (MAGNETO init), rotary theta 1e4, padding id 3, 2048 positions.
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from codonfm_te.modeling_codonfm_te import AUTO_MAP, NVEncodonConfig


# name: (layers, hidden, heads, intermediate)
ENCODON_SHAPES = {
    "encodon_80m": (6, 1024, 8, 4096),
    "encodon_600m": (12, 2048, 16, 8192),
    "encodon_1b": (18, 2048, 16, 8192),
}


def encodon_config(layers: int, hidden: int, heads: int, intermediate: int) -> NVEncodonConfig:
    config = NVEncodonConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        backend="auto",
    )
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["NVEncodonForMaskedLM"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "model_configs")
    args = parser.parse_args()
    for name, shape in ENCODON_SHAPES.items():
        encodon_config(*shape).save_pretrained(args.output_dir / name)
        print(f"wrote {args.output_dir / name / 'config.json'}")


if __name__ == "__main__":
    main()
