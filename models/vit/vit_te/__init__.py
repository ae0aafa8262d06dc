"""Vision Transformer with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face
transformers."""

from .modeling_vit_te import AUTO_MAP, NVViTConfig, NVViTForImageClassification, NVViTModel


__all__ = ["AUTO_MAP", "NVViTConfig", "NVViTForImageClassification", "NVViTModel"]
