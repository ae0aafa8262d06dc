"""ESM-2 with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face transformers."""

from .modeling_esm_te import (
    AUTO_MAP,
    NVEsmConfig,
    NVEsmForMaskedLM,
    NVEsmForTokenClassification,
    NVEsmModel,
)


__all__ = ["AUTO_MAP", "NVEsmConfig", "NVEsmForMaskedLM", "NVEsmForTokenClassification", "NVEsmModel"]
