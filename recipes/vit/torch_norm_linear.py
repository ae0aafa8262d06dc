# Copied from common/torch_norm_linear.py — edit the source, then run ci/check_copies.py --fix
"""Pure-PyTorch twins of TransformerEngine's norm and linear modules: ``LayerNorm``, ``RMSNorm``, ``Linear``,
``LayerNormLinear`` and ``LayerNormMLP``, with TE's constructor arguments (the subset this project uses), parameter
names, state-dict keys and numerics. Part of the torch backend, see torch_layers.py.

TE's ``"gelu"`` kernel is the tanh approximation; here ``"gelu"`` is the exact erf form that ESM and Hugging Face use
(the difference, < 5e-4 per activation, is below bf16 resolution). ``"gelu_tanh"`` is TE's form.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["ExtraStateMixin", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm"]


def _default_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=0.023)  # TE's default init_method


class ExtraStateMixin:
    """Mirror TE's ``_extra_state`` key (TE's FP8 bookkeeping): keep whatever was loaded and hand it back unchanged
    on save. Every twin of a TE module that has the key uses it, the attention twins too."""

    _opaque_extra_state: torch.Tensor | None = None

    def get_extra_state(self) -> torch.Tensor:
        if self._opaque_extra_state is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._opaque_extra_state

    def set_extra_state(self, state) -> None:
        self._opaque_extra_state = state if isinstance(state, torch.Tensor) and state.numel() > 0 else None


def _normalize(
    x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if normalization == "RMSNorm":
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
        return normed.to(x.dtype) * weight
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    if activation == "silu":
        return F.silu(x)
    if activation == "swiglu":  # TE gates with the first half: silu(a) * b
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b
    if activation == "geglu":
        a, b = x.chunk(2, dim=-1)
        return F.gelu(a) * b
    raise ValueError(f"unsupported activation {activation!r}")


class LayerNorm(ExtraStateMixin, nn.Module):
    """``te.LayerNorm``: parameters ``weight`` and ``bias`` (and, as TE's fusible operations have, ``_extra_state``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype=None, device=None, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(ExtraStateMixin, nn.Module):
    """``te.RMSNorm``: parameter ``weight`` (and ``_extra_state``, as ``te.LayerNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype=None, device=None, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(x, "RMSNorm", self.weight, None, self.eps)


class Linear(ExtraStateMixin, nn.Module):
    """``te.Linear``: parameters ``weight`` [out, in] and ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Callable | None = None,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.init_method = init_method or _default_init
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=params_dtype, device=device)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_method(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNormLinear(ExtraStateMixin, nn.Module):
    """``te.LayerNormLinear``: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``weight``, ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        init_method: Callable | None = None,
        return_layernorm_output: bool = False,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.eps = eps
        self.normalization = normalization
        self.init_method = init_method or _default_init
        self.return_layernorm_output = return_layernorm_output
        kwargs = {"dtype": params_dtype, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features, **kwargs))
        self.layer_norm_bias = (
            nn.Parameter(torch.empty(in_features, **kwargs)) if normalization == "LayerNorm" else None
        )
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kwargs))
        self.bias = nn.Parameter(torch.empty(out_features, **kwargs)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        self.init_method(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor):
        """The output, or ``(output, normalised input)`` with ``return_layernorm_output`` (as TE)."""
        normed = _normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        out = F.linear(normed, self.weight, self.bias)
        return (out, normed) if self.return_layernorm_output else out


class LayerNormMLP(ExtraStateMixin, nn.Module):
    """``te.LayerNormMLP``: norm, ``fc1`` (doubled width for gated activations), activation, ``fc2``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        return_layernorm_output: bool = False,
        params_dtype=None,
        device=None,
        **_,
    ):
        super().__init__()
        self.eps = eps
        self.normalization = normalization
        self.activation = activation
        self.return_layernorm_output = return_layernorm_output
        self.init_method = init_method or _default_init
        self.output_layer_init_method = output_layer_init_method or _default_init
        fc1_out = 2 * ffn_hidden_size if activation in ("swiglu", "geglu") else ffn_hidden_size
        kwargs = {"dtype": params_dtype, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, **kwargs))
        self.layer_norm_bias = (
            nn.Parameter(torch.empty(hidden_size, **kwargs)) if normalization == "LayerNorm" else None
        )
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **kwargs))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **kwargs)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **kwargs))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **kwargs)) if bias else None
        if self.fc1_weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        self.init_method(self.fc1_weight)
        self.output_layer_init_method(self.fc2_weight)
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x: torch.Tensor):
        """The output, or ``(output, normalised input)`` with ``return_layernorm_output`` (as TE)."""
        normed = _normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        hidden = _activation(F.linear(normed, self.fc1_weight, self.fc1_bias), self.activation)
        out = F.linear(hidden, self.fc2_weight, self.fc2_bias)
        return (out, normed) if self.return_layernorm_output else out
