"""Write the Llama 3 shapes as local ``config.json`` files with the nucleotide vocabulary, so recipes need no Hub.

    python models/llama3/scripts/make_model_configs.py [--output-dir models/llama3/model_configs]

``llama3-tiny-nucleotide`` is a test shape (a few MB); the others are Meta's published Llama 3.2 1B and
Llama 3.1 8B shapes (layers, widths, GQA groups, RoPE theta and Llama 3 rope scaling, embedding tying) with the
256-token nucleotide vocabulary of ``llama3_te/tokenizer`` in place of the 128,256 text tokens.
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama3_te.modeling_llama_te import AUTO_MAP, NVLlamaConfig


def llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# name: shape and rope settings
SHAPES = {
    "llama3-tiny-nucleotide": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 448,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
    },
    "llama3.2-1b-nucleotide": {
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_parameters": llama3_rope(32.0),
        "tie_word_embeddings": True,
    },
    "llama3.1-8b-nucleotide": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_parameters": llama3_rope(8.0),
        "tie_word_embeddings": False,
    },
}


def llama3_config(**shape) -> NVLlamaConfig:
    config = NVLlamaConfig(
        vocab_size=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        backend="auto",
        **shape,
    )
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["NVLlamaForCausalLM"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "model_configs")
    args = parser.parse_args()
    for name, shape in SHAPES.items():
        llama3_config(**shape).save_pretrained(args.output_dir / name)
        print(f"wrote {args.output_dir / name / 'config.json'}")


if __name__ == "__main__":
    main()
