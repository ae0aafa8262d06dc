"""CodonFM's Encodon with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face."""

from .configuration_codonfm_te import NVEncodonConfig
from .modeling_codonfm_te import (
    AUTO_MAP,
    EncodonLayer,
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
