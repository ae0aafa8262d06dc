"""Helpers for the Geneformer model tests: tiny stock ``BertForMaskedLM`` models with Geneformer's settings, random
weights, and right-padded cell batches (the model contract packs them into THD)."""

import json
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM


COMPONENT_DIR = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = COMPONENT_DIR / "model_configs"

VOCAB_SIZE = 1000  # tiny vocabulary for CPU tests: <pad> = 0, <mask> = 1, genes 2..999
TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}


def hf_geneformer_config(**overrides) -> BertConfig:
    """A stock ``BertConfig`` with Geneformer's settings (ReLU, eps 1e-12), dropout off so outputs can be compared."""
    values = {
        "vocab_size": VOCAB_SIZE,
        "hidden_act": "relu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 256,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        **TINY_SHAPE,
    }
    return BertConfig(**{**values, **overrides})


def shape_of(config_name: str) -> dict:
    values = json.loads((MODEL_CONFIGS / config_name / "config.json").read_text())
    return {key: values[key] for key in TINY_SHAPE}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every weight, bias and LayerNorm a random value, so that a wrong mapping cannot hide behind zeros/ones."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "LayerNorm" in name or "layer_norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        else:
            std = 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.1
            param.copy_(std * torch.randn(param.shape, generator=generator))
    return model


def stock_model(seed: int = 0, **overrides) -> BertForMaskedLM:
    torch.manual_seed(seed)
    return randomize_(BertForMaskedLM(hf_geneformer_config(**overrides)), seed).eval()


def make_batch(lengths: list[int], seed: int = 0, padding_side: str = "right", mask_fraction: float = 0.15) -> dict:
    """Right-padded cells of distinct gene tokens (a rank-value encoding has each gene once), some replaced by
    <mask> and labelled."""
    assert padding_side == "right", "Geneformer batches are padded on the right (absolute positions)"
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    input_ids = torch.zeros((len(lengths), seq_len), dtype=torch.long)  # <pad>
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, length in enumerate(lengths):
        genes = torch.randperm(VOCAB_SIZE - 2, generator=generator)[:length] + 2
        masked = torch.rand(length, generator=generator) < mask_fraction
        masked[0] = True  # every cell has at least one labelled gene
        labels[row, :length] = torch.where(masked, genes, -100)
        input_ids[row, :length] = torch.where(masked, 1, genes)
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
