"""Write the ESM-2 shapes (8M to 15B) as local ``config.json`` files, so recipes need no Hub access.

    python models/esm2/scripts/make_model_configs.py [--output-dir models/esm2/model_configs]

The shapes are those of the published ESM-2 models (Lin et al., 2023).
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from esm2_te.modeling_esm_te import AUTO_MAP, NVEsmConfig


# name: (layers, hidden, heads)
ESM2_SHAPES = {
    "esm2_t6_8M_UR50D": (6, 320, 20),
    "esm2_t12_35M_UR50D": (12, 480, 20),
    "esm2_t30_150M_UR50D": (30, 640, 20),
    "esm2_t33_650M_UR50D": (33, 1280, 20),
    "esm2_t36_3B_UR50D": (36, 2560, 40),
    "esm2_t48_15B_UR50D": (48, 5120, 40),
}


def esm2_config(layers: int, hidden: int, heads: int) -> NVEsmConfig:
    config = NVEsmConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=1026,
        backend="auto",
    )
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["NVEsmForMaskedLM"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "model_configs")
    args = parser.parse_args()
    for name, shape in ESM2_SHAPES.items():
        esm2_config(*shape).save_pretrained(args.output_dir / name)
        print(f"wrote {args.output_dir / name / 'config.json'}")


if __name__ == "__main__":
    main()
