"""Llama 3 with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face transformers."""

from .configuration_llama_te import NVLlamaConfig
from .modeling_llama_te import AUTO_MAP, NVLlamaForCausalLM, NVLlamaModel


__all__ = ["AUTO_MAP", "NVLlamaConfig", "NVLlamaForCausalLM", "NVLlamaModel"]
