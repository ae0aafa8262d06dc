"""AMPLIFY with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face transformers."""

from .configuration_amplify_te import NVAmplifyConfig
from .modeling_amplify_te import AUTO_MAP, NVAmplifyForMaskedLM, NVAmplifyModel


__all__ = ["AUTO_MAP", "NVAmplifyConfig", "NVAmplifyForMaskedLM", "NVAmplifyModel"]
