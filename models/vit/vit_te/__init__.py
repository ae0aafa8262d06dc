"""Vision Transformer with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face
transformers."""

from .configuration_vit_te import NVViTConfig
from .modeling_vit_te import AUTO_MAP, NVViTForImageClassification, NVViTModel


__all__ = ["AUTO_MAP", "NVViTConfig", "NVViTForImageClassification", "NVViTModel"]
