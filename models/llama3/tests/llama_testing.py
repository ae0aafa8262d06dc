"""Helpers for the Llama 3 model tests: tiny configs, random weights, left- or right-padded batches (the model
contract packs them into THD)."""

import json
from pathlib import Path

import torch
from transformers import LlamaConfig


COMPONENT_DIR = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = COMPONENT_DIR / "model_configs"
TOKENIZER_DIR = COMPONENT_DIR / "llama3_te" / "tokenizer"

VOCAB_SIZE = 256  # the nucleotide tokenizer's vocabulary
PAD, BOS, EOS = 0, 1, 2  # ids in that tokenizer

TINY_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
}
TINY_GQA_SHAPE = {**TINY_SHAPE, "num_key_value_heads": 2}
# Llama 3.2 1B's head shape (head_dim 64, 4 query heads per key/value group) at a small width and depth.
GPU_SHAPE = {
    "num_hidden_layers": 3,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny model's head_dim spans all three frequency bands (kept, interpolated, scaled).
    "original_max_position_embeddings": 64,
}


def hf_llama_config(rope_parameters: dict | None = None, tie_word_embeddings: bool = False, **shape) -> LlamaConfig:
    """A stock Hugging Face Llama config of the given shape, with the nucleotide vocabulary."""
    return LlamaConfig(
        **{"vocab_size": VOCAB_SIZE, **shape},
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie_word_embeddings,
    )


def shape_of(config_name: str) -> dict:
    values = json.loads((MODEL_CONFIGS / config_name / "config.json").read_text())
    return {key: values[key] for key in TINY_SHAPE}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every weight and norm a random value, so that a wrong mapping cannot hide behind zeros/ones."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        else:
            std = 1.0 / param.shape[-1] ** 0.5
            param.copy_(std * torch.randn(param.shape, generator=generator))
    return model


def make_batch(lengths: list[int], seed: int = 0, padding_side: str = "right"):
    """<bos> + random nucleotide ids, padded on the given side; labels are the ids (-100 at padding)."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    input_ids = torch.full((len(lengths), seq_len), PAD)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        tokens = torch.cat([torch.tensor([BOS]), torch.randint(5, VOCAB_SIZE, (length - 1,), generator=generator)])
        where = slice(0, length) if padding_side == "right" else slice(seq_len - length, seq_len)
        input_ids[row, where] = tokens
        attention_mask[row, where] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float32."""
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12)).item()
