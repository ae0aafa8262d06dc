"""The configuration of CodonFM's Encodon with TE layers (``NVEncodonConfig``): the published Encodon settings plus
this implementation's settings (backend, per-layer precision, recompute, classification head), each checked when the
config is built. The model is in modeling_codonfm_te.py; this file is shipped with it in every export (``AutoConfig``
in the ``auto_map`` points here)."""

import math

from transformers import PreTrainedConfig


try:  # package import (models/codonfm, exported checkpoints)
    from .activation_recompute import validate_recompute_layers
    from .layer_autocast import validate_layer_precision
except ImportError:  # flat copy inside a recipe folder
    from activation_recompute import validate_recompute_layers
    from layer_autocast import validate_layer_precision


BACKENDS = ("auto", "te", "torch")
ACTIVATIONS = ("gelu", "relu", "silu")  # one Python function per name, the same on both backends
INIT_SCHEMES = ("magneto",)


class NVEncodonConfig(PreTrainedConfig):
    """The published Encodon settings (EncodonPL's init arguments: same names, same defaults) with the smallest
    published shape (encodon_80m), plus the special-token ids, the backend, vocabulary padding, per-layer precision
    and the sequence-classification settings (``num_labels``, ``problem_type``, ``classifier_dropout``)."""

    # There is no Encodon model type in transformers. config.json must name a stock one all the same: a plain
    # ``AutoTokenizer.from_pretrained(export)`` reads config.json, and an unknown type makes it ask to run custom code
    # (which a batch job cannot answer). "bert" (a masked-LM encoder with the same config field names) only lets the
    # tokenizer load without custom code: without ``trust_remote_code`` transformers builds a ``BertForMaskedLM`` that
    # reports every Encodon weight as missing rather than pass for this model. Our classes load through ``auto_map``
    # with ``trust_remote_code=True``; the exported ``architectures`` (NVEncodon...) name the real model.
    model_type = "bert"

    vocab_size: int = 69
    hidden_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    # Every published model uses EncodonPL's default (EnCodonConfig's own default, 1e5, is overridden by it).
    rotary_theta: float = 10000.0
    # The longest sequence (in tokens, <CLS> and <SEP> included) the published models were trained on; the rotary
    # table itself has no limit.
    max_position_embeddings: int = 2048
    cls_token_id: int | None = 0
    sep_token_id: int | None = 1
    unk_token_id: int | None = 2
    pad_token_id: int | None = 3
    mask_token_id: int | None = 4
    tie_word_embeddings: bool = False
    # Dropout before the sequence-classification head; None: hidden_dropout_prob.
    classifier_dropout: float | None = None
    # The init the weights are drawn from, named so that shared init checks (tests/init_statistics.py) know it.
    init_scheme: str = "magneto"
    # "auto" | "te" | "torch"; see modeling_codonfm_te.py's docstring.
    backend: str = "auto"
    # Embedding/decoder rows, rounded up so the vocabulary GEMM is well aligned. None: vocab_size rounded to 64 (128).
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
        self.validate_nv_encodon()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate_nv_encodon(self) -> None:
        """Raise ``ValueError`` naming every setting this implementation cannot honour."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.init_scheme not in INIT_SCHEMES:
            problems.append(
                f"init_scheme must be one of {INIT_SCHEMES} (the published init), got {self.init_scheme!r}"
            )
        if self.tie_word_embeddings:
            problems.append("tie_word_embeddings must be False: Encodon's decoder is not tied to the embedding")
        if self.num_hidden_layers <= 0 or self.hidden_size <= 0 or self.intermediate_size <= 0:
            problems.append("num_hidden_layers, hidden_size and intermediate_size must be positive")
        elif self.num_attention_heads <= 0 or self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        elif self.head_dim % 2:
            problems.append(f"the head dimension ({self.head_dim}) must be even (rotary embeddings rotate pairs)")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                problems.append(f"{name} must be in [0, 1), got {value!r}")
        if self.rotary_theta <= 0 or self.initializer_range <= 0 or self.layer_norm_eps <= 0:
            problems.append("rotary_theta, initializer_range and layer_norm_eps must be positive")
        if self.vocab_size is None or self.vocab_size <= 0:
            problems.append(f"vocab_size must be positive, got {self.vocab_size!r}")
        else:
            if self.padded_vocab_size < self.vocab_size:
                problems.append(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
            if self.pad_token_id is None or not 0 <= self.pad_token_id < self.vocab_size:
                problems.append(f"pad_token_id must be a token id below vocab_size, got {self.pad_token_id!r}")
        problems += validate_layer_precision(self.layer_precision, self.num_hidden_layers)
        problems += validate_recompute_layers(self.recompute_layers, self.num_hidden_layers)
        if problems:
            raise ValueError("Invalid NVEncodonConfig: " + "; ".join(problems))
