"""The configuration of the TE-accelerated AMPLIFY (``NVAmplifyConfig``): the published AMPLIFY settings plus this
implementation's settings (backend, per-layer precision, recompute, fused layers), each checked when the config is
built. The model is in modeling_amplify_te.py; this file is shipped with it in every export (``AutoConfig`` in
the ``auto_map`` points here)."""

import math

from transformers import PreTrainedConfig


try:  # package import (models/amplify, exported checkpoints)
    from .activation_recompute import validate_recompute_layers
    from .layer_autocast import validate_layer_precision
except ImportError:  # flat copy inside a recipe folder
    from activation_recompute import validate_recompute_layers
    from layer_autocast import validate_layer_precision


BACKENDS = ("auto", "te", "torch")


def swiglu_hidden_size(intermediate_size: int) -> int:
    """AMPLIFY's SwiGLU width: 2/3 of ``intermediate_size`` (same parameter count as a plain MLP of that width),
    rounded up to a multiple of 8 (aligned GEMMs). 2560 -> 1712 (120M), 3840 -> 2560 (350M)."""
    return 8 * math.ceil(int(2 * intermediate_size / 3) / 8)


class NVAmplifyConfig(PreTrainedConfig):
    """The published AMPLIFY config fields (same names, same defaults: the 350M shape) plus the backend, the rotary
    base, vocabulary padding and per-layer precision."""

    # There is no AMPLIFY model type in transformers. config.json must name a stock one all the same: a plain
    # ``AutoTokenizer.from_pretrained(export)`` reads config.json, and an unknown type makes it ask to run custom code
    # (which a batch job cannot answer). "esm" is the closest stock type (a masked protein language model with rotary
    # embeddings), but it does not describe AMPLIFY: it only lets the tokenizer load without custom code, and without
    # ``trust_remote_code`` transformers builds an ``EsmForMaskedLM`` that reports every AMPLIFY weight as missing
    # rather than pass for this model. Our classes load through ``auto_map`` with ``trust_remote_code=True``; the
    # exported ``architectures`` (NVAmplify...) name the real model.
    model_type = "esm"

    vocab_size: int = 27
    hidden_size: int = 960
    num_hidden_layers: int = 32
    num_attention_heads: int = 15
    # The published width before SwiGLU's 2/3 scaling; the FFN is ``swiglu_hidden_size(intermediate_size)`` wide.
    intermediate_size: int = 3840
    dropout_prob: float = 0.0
    # Half-widths of the uniform init: embedding rows ~ U(-embedding_init_range, +...), every linear weight
    # ~ U(-decoder_init_range, +...) (the published name; it covers all linears, not only the decoder).
    embedding_init_range: float = 0.02
    decoder_init_range: float = 0.02
    rms_norm: bool = True
    norm_eps: float = 1e-5
    hidden_act: str = "SwiGLU"
    layer_norm_after_embedding: bool = False
    layer_norm_before_last_layer: bool = True
    ffn_bias: bool = False
    att_bias: bool = False
    pad_token_id: int | None = 0
    unk_token_id: int | None = 1
    mask_token_id: int | None = 2
    bos_token_id: int | None = 3
    eos_token_id: int | None = 4
    other_special_token_ids: list | None = None
    max_length: int = 2048  # longest sequence the published rotary table covers
    tie_word_embeddings: bool = False
    # The published code hard-codes the rotary base.
    rope_theta: float = 10000.0
    # "auto" | "te" | "torch"; see modeling_amplify_te.py's docstring.
    backend: str = "auto"
    # Embedding/decoder rows, rounded up so the vocabulary GEMM is well aligned. None: vocab_size rounded to 64.
    padded_vocab_size: int | None = None
    # One entry per layer: None (bf16/fp32), "fp8" or "fp4"; the matching TE recipe is passed to the model.
    layer_precision: list | None = None
    # Layers, from the first, whose activations backward recomputes instead of keeping (activation_recompute.py):
    # each saves its activation memory for about a third more of its compute. Training only; 0 keeps everything.
    recompute_layers: int = 0
    # TE backend: rotate queries and keys right after the fused QKV projection (packed_rope.py: one Triton kernel,
    # attention gets one packed QKV tensor) instead of TE's RoPE. Same numbers; off under context parallelism.
    # Off by default for AMPLIFY: it saves GPU time (350M, 32k tokens, 1xH100: 182 vs 188 ms busy per step), but
    # that step is host-bound (GPU ~70% busy) and the kernel's Python hooks cost more host time than they save:
    # 146-156k vs 158-164k tokens/s. ESM-2 650M (GPU-bound) gains 3-4% and has it on (docs/benchmarks.md).
    fused_qkv_rope: bool = False
    # TE backend: build the layers as FusedResidualTransformerLayer (fused_residual_layer.py): the same parameters and
    # numbers as TE's layer, with the residual adds done inside Triton RMSNorm kernels (three fewer passes over the
    # activations per layer). Always rotates inside the QKV projection (as fused_qkv_rope=True). bf16/fp32 or FP8
    # layers (DelayedScaling, Float8CurrentScaling, Float8BlockScaling: TE's FP8 GEMMs behind these norm kernels); no
    # FP4 layers, no context parallelism. 350M, 64k tokens, 1xH100: docs/benchmarks.md.
    fused_residual_norm: bool = False
    # The layer precisions (layer_precision entries) that the fused layers compute in.
    fused_residual_norm_precisions = (None, "fp8")
    # Derived, not a setting: the standard deviation of the linear init, decoder_init_range / sqrt(3) (a uniform
    # draw on [-r, r] has std r / sqrt(3)). The project's shared init checks read it.
    initializer_range: float | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.padded_vocab_size is None and self.vocab_size is not None:
            self.padded_vocab_size = 64 * math.ceil(self.vocab_size / 64)
        self.initializer_range = self.decoder_init_range / math.sqrt(3)
        self.validate_nv_amplify()

    @property
    def ffn_hidden_size(self) -> int:
        return swiglu_hidden_size(self.intermediate_size)

    def validate_nv_amplify(self) -> None:
        """Raise ``ValueError`` naming every setting this implementation cannot honour."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.rms_norm:
            problems.append("rms_norm=False (LayerNorm) is not supported: the published models use RMSNorm")
        if str(self.hidden_act).lower() != "swiglu":
            problems.append(f"only hidden_act='SwiGLU' is supported, got {self.hidden_act!r}")
        if self.att_bias or self.ffn_bias:
            problems.append("att_bias and ffn_bias must be False (the published models have no biases there)")
        if self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        elif (self.hidden_size // self.num_attention_heads) % 2:
            problems.append(
                f"the head dimension ({self.hidden_size // self.num_attention_heads}) must be even (rotary)"
            )
        if self.vocab_size is None or self.vocab_size <= 0:
            problems.append(f"vocab_size must be positive, got {self.vocab_size!r}")
        elif self.padded_vocab_size < self.vocab_size:
            problems.append(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
        problems += validate_layer_precision(self.layer_precision, self.num_hidden_layers)
        problems += validate_recompute_layers(self.recompute_layers, self.num_hidden_layers)
        if self.fused_residual_norm and any(
            p not in self.fused_residual_norm_precisions for p in self.layer_precision or []
        ):
            problems.append(
                "fused_residual_norm layers compute in bf16/fp32 or FP8: layer_precision entries must be None or 'fp8'"
            )
        if problems:
            raise ValueError("Invalid NVAmplifyConfig: " + "; ".join(problems))
