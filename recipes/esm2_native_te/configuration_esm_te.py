# Copied from models/esm2/esm2_te/configuration_esm_te.py — edit the source, then run ci/check_copies.py --fix
"""The configuration of the TE-accelerated ESM-2 (``NVEsmConfig``): Hugging Face's ``EsmConfig`` plus this
implementation's settings (backend, per-layer precision, recompute, fused layers), each checked when the config is
built. The model is in modeling_esm_te.py; this file is shipped with it in every export (``AutoConfig`` in the
``auto_map`` points here)."""

import math

from transformers import EsmConfig


try:  # package import (models/esm2, exported checkpoints)
    from .activation_recompute import validate_recompute_layers
    from .layer_autocast import validate_layer_precision
except ImportError:  # flat copy inside a recipe folder
    from activation_recompute import validate_recompute_layers
    from layer_autocast import validate_layer_precision


BACKENDS = ("auto", "te", "torch")


class NVEsmConfig(EsmConfig):
    """``EsmConfig`` plus the backend, vocabulary padding and per-layer precision. Defaults are ESM-2's."""

    # The stock model type, so that a plain ``AutoTokenizer.from_pretrained(export)`` (which reads config.json)
    # finds a config class without running custom code and never asks to. Our classes load through ``auto_map``
    # with ``trust_remote_code=True``; the exported ``architectures`` (NVEsm...) tell the two layouts apart.
    model_type = "esm"

    vocab_size: int | None = 33
    mask_token_id: int | None = 32
    pad_token_id: int | None = 1
    hidden_dropout_prob: float | None = 0.0
    attention_probs_dropout_prob: float | None = 0.0
    layer_norm_eps: float | None = 1e-5
    position_embedding_type: str | None = "rotary"
    emb_layer_norm_before: bool | None = False
    token_dropout: bool | None = True
    # "auto" | "te" | "torch"; see modeling_esm_te.py's docstring.
    backend: str = "auto"
    # Embedding/LM-head rows, rounded up so the vocabulary GEMM is well aligned. None: vocab_size rounded to 64.
    padded_vocab_size: int | None = None
    # One entry per layer: None (bf16/fp32), "fp8" or "fp4"; the matching TE recipe is passed to the model.
    layer_precision: list | None = None
    # Layers, from the first, whose activations backward recomputes instead of keeping (activation_recompute.py):
    # each saves its activation memory for about a third more of its compute. Training only; 0 keeps everything.
    recompute_layers: int = 0
    # TE backend: rotate queries and keys right after the fused QKV projection (packed_rope.py: one Triton kernel,
    # attention gets one packed QKV tensor) instead of TE's RoPE. Same numbers; off under context parallelism.
    fused_qkv_rope: bool = True
    # TE backend: build the layers as FusedResidualTransformerLayer (fused_residual_layer.py): the same parameters as
    # TE's layer, the residual adds inside Triton LayerNorm kernels, the biases added by the GEMMs (650M, 48k tokens,
    # 1xH100: +2.4% tokens/s). Its losses equal those of TE's layer with TE's bias-dropout-add run eagerly; TE's
    # compiled one lets still-tiny biases break bf16 ties, which lowers the loss over the first ~20 steps
    # (docs/benchmarks.md). Always rotates inside the QKV projection. bf16/fp32 or FP8 layers (DelayedScaling,
    # Float8CurrentScaling, Float8BlockScaling: TE's FP8 GEMMs behind these norm kernels); no FP4 layers, no dropout,
    # no context parallelism.
    fused_residual_norm: bool = False
    # The layer precisions (layer_precision entries) that the fused layers compute in.
    fused_residual_norm_precisions = (None, "fp8")

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.padded_vocab_size is None and self.vocab_size is not None:
            self.padded_vocab_size = 64 * math.ceil(self.vocab_size / 64)
        self.validate_nv_esm()

    def validate_nv_esm(self) -> None:
        """Raise ``ValueError`` naming the first setting this implementation cannot honour."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.position_embedding_type != "rotary":
            problems.append(
                f"only position_embedding_type='rotary' (ESM-2) is supported, got {self.position_embedding_type!r}"
            )
        if self.emb_layer_norm_before:
            problems.append("emb_layer_norm_before=True (ESM-1b) is not supported")
        if self.is_decoder or self.add_cross_attention:
            problems.append("ESM-2 is an encoder: is_decoder and add_cross_attention must be False")
        if self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        if self.vocab_size is None or self.vocab_size <= 0:
            problems.append(f"vocab_size must be positive, got {self.vocab_size!r}")
        elif self.padded_vocab_size < self.vocab_size:
            problems.append(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
        if self.token_dropout and self.mask_token_id is None:
            problems.append("token_dropout needs mask_token_id")
        problems += validate_layer_precision(self.layer_precision, self.num_hidden_layers)
        problems += validate_recompute_layers(self.recompute_layers, self.num_hidden_layers)
        if self.fused_residual_norm:
            if any(p not in self.fused_residual_norm_precisions for p in self.layer_precision or []):
                problems.append(
                    "fused_residual_norm layers compute in bf16/fp32 or FP8: layer_precision entries must be None or "
                    "'fp8'"
                )
            if self.hidden_dropout_prob or self.attention_probs_dropout_prob:
                problems.append(
                    "fused_residual_norm layers have no dropout: hidden_dropout_prob and attention_probs_dropout_prob "
                    "must be 0"
                )
        if problems:
            raise ValueError("Invalid NVEsmConfig: " + "; ".join(problems))
