"""Tiny stock Hugging Face ViTs with random weights, and the NV configs the tests build (no Hub access)."""

import torch
from transformers import ViTConfig, ViTForImageClassification

from vit_te.modeling_vit_te import NVViTConfig


def stock_vit(seed: int = 0, **overrides) -> ViTForImageClassification:
    """A seeded stock ViT whose weights are random everywhere (no LayerNorm at exactly 1, no bias at exactly 0), so a
    conversion that drops or swaps a tensor shows in the outputs."""
    settings = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "image_size": 32,
        "patch_size": 8,
        "num_labels": 5,
        "attn_implementation": "eager",
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(**settings))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def vit_tiny_shape_at_64_pixels() -> ViTForImageClassification:
    """ViT-Tiny's width, heads and MLP (192, 3, 768) with 16-pixel patches, two layers, at 64 pixels."""
    return stock_vit(
        seed=1, hidden_size=192, num_attention_heads=3, intermediate_size=768, image_size=64, patch_size=16
    )


def images(batch: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=generator)


def init_config(**overrides) -> NVViTConfig:
    """A model wide enough for meaningful init statistics (hidden 256), on the torch backend."""
    settings = {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 512,
        "image_size": 32,
        "patch_size": 8,
        "num_labels": 10,
        "backend": "torch",
    }
    settings.update(overrides)
    return NVViTConfig(**settings)
