"""The configuration of the TE-accelerated Vision Transformer (``NVViTConfig``): Hugging Face's ``ViTConfig`` plus
this implementation's settings (backend, per-layer precision), each checked when the config is built. The model is in
modeling_vit_te.py; this file is shipped with it in every export (``AutoConfig`` in the ``auto_map`` points
here)."""

from transformers import ViTConfig


try:  # package import (models/vit, exported checkpoints)
    from .layer_autocast import validate_layer_precision
except ImportError:  # flat copy inside a recipe folder
    from layer_autocast import validate_layer_precision


BACKENDS = ("auto", "te", "torch")
# FP8/FP4 GEMMs need the token count (the rows of every GEMM) to be a multiple of 16.
QUANTIZED_TOKEN_ALIGNMENT = 16


def as_pair(value) -> tuple[int, int]:
    """An image or patch size given as one int or as (height, width)."""
    return tuple(value) if isinstance(value, list | tuple) else (value, value)


class NVViTConfig(ViTConfig):
    """``ViTConfig`` plus the backend and per-layer precision. Defaults are ViT-Base/16 at 224 pixels."""

    # The stock model type, so that Hugging Face's image processors and a plain AutoConfig read an export without
    # running custom code. Our classes load through ``auto_map`` with ``trust_remote_code=True``; the exported
    # ``architectures`` (NVViT...) tell the two layouts apart.
    model_type = "vit"

    # "auto" | "te" | "torch"; see modeling_vit_te.py's docstring.
    backend: str = "auto"
    # One entry per layer: None (bf16/fp32), "fp8" or "fp4"; the matching TE recipe is passed to the model.
    layer_precision: list | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_nv_vit()

    def validate_nv_vit(self) -> None:
        """Raise ``ValueError`` naming every setting this implementation cannot honour."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.hidden_act != "gelu":
            problems.append(f"only hidden_act='gelu' is supported, got {self.hidden_act!r}")
        if not self.qkv_bias:
            problems.append("qkv_bias=False is not supported (TE's layers give every projection a bias)")
        if self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        for side in as_pair(self.image_size):
            if side % self.patch_size:
                problems.append(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
                break
        problems += validate_layer_precision(self.layer_precision, self.num_hidden_layers)
        if problems:
            raise ValueError("Invalid NVViTConfig: " + "; ".join(problems))
