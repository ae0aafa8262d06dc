"""CodonFM's Encodon with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face."""

from .modeling_codonfm_te import (
    AUTO_MAP,
    EncodonLayer,
    NVEncodonConfig,
    NVEncodonForMaskedLM,
    NVEncodonForSequenceClassification,
    NVEncodonModel,
)


__all__ = [
    "AUTO_MAP",
    "EncodonLayer",
    "NVEncodonConfig",
    "NVEncodonForMaskedLM",
    "NVEncodonForSequenceClassification",
    "NVEncodonModel",
]
