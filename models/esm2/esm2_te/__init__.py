"""ESM-2 with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face transformers."""

from .configuration_esm_te import NVEsmConfig
from .modeling_esm_te import (
    AUTO_MAP,
    NVEsmForMaskedLM,
    NVEsmForTokenClassification,
    NVEsmModel,
)


__all__ = ["AUTO_MAP", "NVEsmConfig", "NVEsmForMaskedLM", "NVEsmForTokenClassification", "NVEsmModel"]
