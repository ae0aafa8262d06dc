# Copied from models/geneformer/geneformer_te/configuration_geneformer_te.py — edit the source, then run ci/check_copies.py --fix
"""The configuration of the TE-accelerated Geneformer (``NVGeneformerConfig``): Hugging Face's ``BertConfig`` plus
this implementation's settings (backend, per-layer precision, recompute), each checked when the config is built. The
model is in modeling_geneformer_te.py; this file is shipped with it in every export (``AutoConfig`` in the
``auto_map`` points here)."""

import math

from transformers import BertConfig


try:  # package import (models/geneformer, exported checkpoints)
    from .activation_recompute import validate_recompute_layers
    from .layer_autocast import validate_layer_precision
except ImportError:  # flat copy inside a recipe folder
    from activation_recompute import validate_recompute_layers
    from layer_autocast import validate_layer_precision


BACKENDS = ("auto", "te", "torch")
ACTIVATIONS = ("relu", "gelu")  # TE's names; TE's "gelu" is the tanh approximation, the torch backend's the exact one


class NVGeneformerConfig(BertConfig):
    """``BertConfig`` with Geneformer's defaults (the 10M model: 6 layers, hidden 256), plus the backend, vocabulary
    padding and per-layer precision."""

    # The stock model type, so that a plain ``AutoTokenizer.from_pretrained(export)`` finds a config class without
    # running custom code and never asks to. Our classes load through ``auto_map`` with ``trust_remote_code=True``.
    model_type = "bert"

    vocab_size: int = 25_426  # <pad> = 0, <mask> = 1 and 25,424 genes (Genecorpus-30M)
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    intermediate_size: int = 512
    hidden_act: str = "relu"
    hidden_dropout_prob: float | int = 0.02
    attention_probs_dropout_prob: float | int = 0.02
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    mask_token_id: int | None = 1
    # "auto" | "te" | "torch"; see modeling_geneformer_te.py's docstring.
    backend: str = "auto"
    # Embedding/LM-head rows, rounded up so the vocabulary GEMM is well aligned. None: vocab_size rounded to 64.
    padded_vocab_size: int | None = None
    # One entry per layer: None (bf16/fp32), "fp8" or "fp4"; the matching TE recipe is passed to the model.
    layer_precision: list | None = None
    # Layers, from the first, whose activations backward recomputes instead of keeping (activation_recompute.py):
    # each saves its activation memory for about a third more of its compute. Training only; 0 keeps everything.
    recompute_layers: int = 0

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.padded_vocab_size is None and self.vocab_size is not None:
            self.padded_vocab_size = 64 * math.ceil(self.vocab_size / 64)
        self.validate_nv_geneformer()

    def validate_nv_geneformer(self) -> None:
        """Raise ``ValueError`` naming every setting this implementation cannot honour."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.is_decoder or self.add_cross_attention:
            problems.append("Geneformer is an encoder: is_decoder and add_cross_attention must be False")
        if self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        if self.vocab_size is None or self.vocab_size <= 0:
            problems.append(f"vocab_size must be positive, got {self.vocab_size!r}")
        elif self.padded_vocab_size < self.vocab_size:
            problems.append(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
        if self.max_position_embeddings <= 0 or self.type_vocab_size <= 0:
            problems.append("max_position_embeddings and type_vocab_size must be positive")
        problems += validate_layer_precision(self.layer_precision, self.num_hidden_layers)
        problems += validate_recompute_layers(self.recompute_layers, self.num_hidden_layers)
        if problems:
            raise ValueError("Invalid NVGeneformerConfig: " + "; ".join(problems))
