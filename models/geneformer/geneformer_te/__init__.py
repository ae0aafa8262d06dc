"""Geneformer with TransformerEngine layers (and a pure-PyTorch fallback), compatible with Hugging Face transformers."""

from .configuration_geneformer_te import NVGeneformerConfig
from .gene_tokenizer import build_gene_tokenizer
from .modeling_geneformer_te import AUTO_MAP, NVGeneformerForMaskedLM, NVGeneformerModel


__all__ = ["AUTO_MAP", "NVGeneformerConfig", "NVGeneformerForMaskedLM", "NVGeneformerModel", "build_gene_tokenizer"]
