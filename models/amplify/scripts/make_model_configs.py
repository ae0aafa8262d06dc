"""Write the published AMPLIFY shapes (120M, 350M) as local ``config.json`` files, so recipes need no Hub access.

    python models/amplify/scripts/make_model_configs.py [--output-dir models/amplify/model_configs]

The shapes are those of the published checkpoints chandar-lab/AMPLIFY_120M and chandar-lab/AMPLIFY_350M (Fournier et
al., 2024); every other field keeps the published default (RMSNorm eps 1e-5, SwiGLU, no biases, max_length 2048,
uniform init +-0.02, final norm on, embedding norm off).
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from amplify_te.modeling_amplify_te import AUTO_MAP, NVAmplifyConfig


# name: (layers, hidden, heads, intermediate)
AMPLIFY_SHAPES = {
    "AMPLIFY_120M": (24, 640, 10, 2560),
    "AMPLIFY_350M": (32, 960, 15, 3840),
}


def amplify_config(layers: int, hidden: int, heads: int, intermediate: int) -> NVAmplifyConfig:
    config = NVAmplifyConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        backend="auto",
    )
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["NVAmplifyForMaskedLM"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "model_configs")
    args = parser.parse_args()
    for name, shape in AMPLIFY_SHAPES.items():
        amplify_config(*shape).save_pretrained(args.output_dir / name)
        print(f"wrote {args.output_dir / name / 'config.json'}")


if __name__ == "__main__":
    main()
