"""Write the Geneformer shapes as local ``config.json`` files, so recipes need no Hub access.

    python models/geneformer/scripts/make_model_configs.py [--output-dir models/geneformer/model_configs]

Sources of the shapes:

- ``geneformer_10M``: Geneformer V1 (Theodoris et al., Nature 2023; the published ``ctheodoris/Geneformer``
  config.json): 6 layers, hidden 256, 4 heads, FFN 512, ReLU, 2,048 genes, vocabulary 25,426.
- ``geneformer_106M``: the 12-layer BERT-base width (hidden 768, 12 heads, FFN 3,072) of the larger Geneformer
  models of Chen et al. 2024, with the V1 vocabulary and input size, as the issue asks (the published V2 models
  use a 20,275-token vocabulary and 4,096 genes; change ``vocab_size``/``max_position_embeddings`` for those).
- ``geneformer_4B``: the "4b" shape of the public reference recipe (bionemo-recipes
  ``geneformer_native_te_mfsdp_fp8/hydra_config/model/4b.yaml``): 36 layers, hidden 2,560, 40 heads, FFN 10,240,
  2,048 genes. That is 2.9 billion parameters with this vocabulary; the Geneformer papers publish no model of this
  size, the name follows the reference.

Every shape uses Geneformer's dropout (0.02), layer-norm epsilon (1e-12) and initializer range (0.02).
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from geneformer_te.modeling_geneformer_te import AUTO_MAP, NVGeneformerConfig


# name: (layers, hidden, heads, ffn)
GENEFORMER_SHAPES = {
    "geneformer_10M": (6, 256, 4, 512),
    "geneformer_106M": (12, 768, 12, 3072),
    "geneformer_4B": (36, 2560, 40, 10240),
}


def geneformer_config(layers: int, hidden: int, heads: int, ffn: int) -> NVGeneformerConfig:
    config = NVGeneformerConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=ffn,
        backend="auto",
    )
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["NVGeneformerForMaskedLM"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "model_configs")
    args = parser.parse_args()
    for name, shape in GENEFORMER_SHAPES.items():
        geneformer_config(*shape).save_pretrained(args.output_dir / name)
        print(f"wrote {args.output_dir / name / 'config.json'}")


if __name__ == "__main__":
    main()
