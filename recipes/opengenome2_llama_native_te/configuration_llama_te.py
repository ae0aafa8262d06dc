# Copied from models/llama3/llama3_te/configuration_llama_te.py — edit the source, then run ci/check_copies.py --fix
"""The configuration of the TE-accelerated Llama 3 (``NVLlamaConfig``): Hugging Face's ``LlamaConfig`` plus this
implementation's settings (backend, per-layer precision, recompute, fused layers), each checked when the config is
built. The model is in modeling_llama_te.py; this file is shipped with it in every export (``AutoConfig`` in the
``auto_map`` points here)."""

import math

from transformers import LlamaConfig


try:  # package import (models/llama3, exported checkpoints)
    from .activation_recompute import validate_recompute_layers
    from .layer_autocast import validate_layer_precision
except ImportError:  # flat copy inside a recipe folder
    from activation_recompute import validate_recompute_layers
    from layer_autocast import validate_layer_precision


BACKENDS = ("auto", "te", "torch")
ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class NVLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus the backend, vocabulary padding and per-layer precision.

    RoPE settings live where transformers 5 keeps them, ``config.rope_parameters`` (``rope_theta``,
    ``rope_type`` and, for ``"llama3"``, ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``); the legacy ``rope_scaling``/``rope_theta`` arguments are accepted.
    """

    # The stock model type, so that a plain ``AutoTokenizer.from_pretrained(export)`` (which reads config.json)
    # finds a config class without running custom code and never asks to. Our classes load through ``auto_map``
    # with ``trust_remote_code=True``; the exported ``architectures`` (NVLlama...) tell the two layouts apart.
    model_type = "llama"

    # "auto" | "te" | "torch"; see modeling_llama_te.py's docstring.
    backend: str = "auto"
    # Embedding/LM-head rows, rounded up so the vocabulary GEMM is well aligned. None: vocab_size rounded to 64.
    padded_vocab_size: int | None = None
    # One entry per layer: None (bf16/fp32), "fp8" or "fp4"; the matching TE recipe is passed to the model.
    layer_precision: list | None = None
    # Layers, from the first, whose activations backward recomputes instead of keeping (activation_recompute.py):
    # each saves its activation memory for about a third more of its compute. Training only; 0 keeps everything.
    recompute_layers: int = 0
    # Std of the input-embedding init; None = initializer_range. 1.0 is "Spike No More" (Takase et al., 2023):
    # unit-scale embeddings keep early-training gradient spikes small (use it with untied embeddings).
    embedding_init_std: float | None = None
    # Megatron-style depth scaling: the attention output projection and the MLP down projection start with
    # std initializer_range / sqrt(2 * num_hidden_layers), so the residual stream's variance does not grow with depth.
    scale_output_projection_init: bool = False
    # TE backend: build the layers as FusedResidualTransformerLayer (fused_residual_layer.py): the same parameters and
    # numbers as TE's layer, with the residual adds done inside Triton RMSNorm kernels and queries and keys rotated
    # as they are copied out of the QKV projection for attention (packed_rope.py) instead of TE's RoPE kernels.
    # bf16/fp32 or FP8 layers (DelayedScaling, Float8CurrentScaling, Float8BlockScaling: TE's FP8 GEMMs behind these
    # norm kernels); no FP4 layers, no context parallelism, no torch.compile. Ignored by the torch backend (an export
    # loads anywhere). 1B shape on one GPU: docs/benchmarks.md.
    fused_residual_norm: bool = False
    # The layer precisions (layer_precision entries) that the fused layers compute in.
    fused_residual_norm_precisions = (None, "fp8")

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.padded_vocab_size is None and self.vocab_size is not None:
            self.padded_vocab_size = 64 * math.ceil(self.vocab_size / 64)
        self.validate_nv_llama()

    def validate_nv_llama(self) -> None:
        """Raise ``ValueError`` naming the first setting this implementation cannot honour."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.hidden_act != "silu":
            problems.append(f"only hidden_act='silu' (SwiGLU) is supported, got {self.hidden_act!r}")
        if self.attention_bias or self.mlp_bias:
            problems.append("attention_bias and mlp_bias must be False (Llama 3 has no biases)")
        if self.pretraining_tp not in (None, 1):
            problems.append(f"pretraining_tp must be 1, got {self.pretraining_tp}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.vocab_size is None or self.vocab_size <= 0:
            problems.append(f"vocab_size must be positive, got {self.vocab_size!r}")
        elif self.padded_vocab_size < self.vocab_size:
            problems.append(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
        rope = self.rope_parameters or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            problems.append(f"rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
        elif rope_type == "llama3":
            missing = [key for key in _LLAMA3_ROPE_KEYS if rope.get(key) is None]
            if missing:
                problems.append(f"rope_type 'llama3' needs {missing} in rope_parameters")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append("partial_rotary_factor != 1 is not supported")
        if self.embedding_init_std is not None and not self.embedding_init_std > 0:
            problems.append(f"embedding_init_std must be positive or None, got {self.embedding_init_std!r}")
        problems += validate_layer_precision(self.layer_precision, self.num_hidden_layers)
        if self.fused_residual_norm and any(
            p not in self.fused_residual_norm_precisions for p in self.layer_precision or []
        ):
            problems.append(
                "fused_residual_norm layers compute in bf16/fp32 or FP8: layer_precision entries must be None or 'fp8'"
            )
        problems += validate_recompute_layers(self.recompute_layers, self.num_hidden_layers)
        if problems:
            raise ValueError("Invalid NVLlamaConfig: " + "; ".join(problems))
