# Copied from common/fused_residual_layer.py — edit the source, then run ci/check_copies.py --fix
"""A pre-norm encoder layer for packed (THD) input whose residual adds live in the norm kernels.

``FusedResidualTransformerLayer`` computes what ``te.TransformerLayer(attn_input_format="thd",
qkv_weight_interleaved=True, ...)`` computes for the two pre-norm layers this project trains with it, with the same
parameter names and state-dict keys, so that a model can switch between the two and checkpoints load either way:

* AMPLIFY's: ``normalization="RMSNorm", activation="swiglu", bias=False``;
* ESM-2's: ``normalization="LayerNorm", activation="gelu", bias=True`` (GELU as TE's, tanh-approximated);
* Llama's: AMPLIFY's with grouped-query attention (``num_gqa_groups``) and causal masking
  (``self_attn_mask_type="padding_causal"``).

    self_attention.layernorm_qkv.{layer_norm_weight, layer_norm_bias, weight, bias}, self_attention.proj.{weight,
    bias}, layernorm_mlp.{layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias}
    (the biases where the layer has them, and TE's ``_extra_state`` keys)

What differs is how the work is split into kernels (residual_norm.py): TE's layer spends a separate elementwise
kernel on each residual add in the forward and on each sum of two gradients in the backward (four per layer, each a
full pass over [tokens, hidden]; with biases, the forward adds are TE's compiled bias-dropout-add). Here the
attention's residual add is done by the FFN norm's kernel (which writes the sum and its normalised form in one pass)
and both backward sums by the norms' backward kernels; the layer's last add is left to the next layer's first norm
kernel when the caller chains layers with ``defer_residual`` (see ``forward``), else it is a separate kernel. The
GEMMs are cuBLAS's, as TE's are in bf16: without biases torch's; with biases TE's ``general_gemm``, so that each bias
is added by its GEMM's epilogue and, for the projections that narrow or keep the width (proj, fc2), its gradient
summed by the weight-gradient GEMM's epilogue (as ``te.Linear`` does); the widening ones (QKV, fc1) sum their bias
gradient in a separate column sum, which is cheaper there (``_weight_and_bias_grad``). With fp32 master weights
under bf16 autocast (DDP) every GEMM is TE's, and its weight-gradient GEMM writes the float32 gradient itself (no
bf16 gradient cast afterwards, as TE's fp32 ``main_grad``). GELU runs in the fc1 GEMM's
epilogue and its derivative in the fc2 data-gradient GEMM's (as ``te.LayerNormMLP`` does with
``bias_gelu_nvfusion`` off); SwiGLU is TE's kernel. Attention is TE's fused attention on query/key/value views of
the QKV projection, called through ``te_attention.PackedCuDNNAttention`` (TE's cuDNN kernels without
``DotProductAttention``'s per-call Python once TE has chosen them); where the caller says that the first sequences
are all ``max_seqlen_q`` tokens long (``leading_full_sequences``: full genome windows put first), those run as one
dense [sequences, max_seqlen_q] (BSHD) batch and the rest packed, see ``_SelfAttention.attend``. Rotary embeddings
must be applied inside the QKV projection (packed_rope.py's forward hook on ``self_attention.layernorm_qkv``, which
this layer's projection returns as ``(qkv, residual)``).

The projections are TE's own modules (``NormQKV`` a ``te.Linear``, ``EpilogueLinear`` a ``te.Linear``, ``AddNormMLP``
a ``te.LayerNormMLP``) with forwards of their own, so that they hold TE's parameters, ``_extra_state`` and FP8
scaling state. Under TE's FP8 autocast (``DelayedScaling``, ``Float8CurrentScaling`` or ``Float8BlockScaling``) the
norms are still this file's kernels and the GEMMs are TE's FP8 ones: ``te.Linear``'s forward for QKV and proj, and
for the MLP fp8_mlp.py's ``QuantizedMLP`` (TE's FP8 MLP without its norm: the activation writes fc2's FP8 input). Under
``DelayedScaling`` the norms write their GEMM's FP8 input themselves (``_norm_fp8_output``) and ESM-2's GELU runs in
fc1's GEMM's epilogue, writing fc2's FP8 input; under the other two the norms write bf16 and TE casts it.
TE's layer spends its general LayerNorm kernels there (hidden 1,280 has no tuned one) and the four residual passes:
on one H200 ESM-2 650M's FP8 step is 12.5 ms shorter with this layer (+3.9% tokens/s) and AMPLIFY 350M's +12.8%
(docs/benchmarks.md). No FP4/MXFP8 (Blackwell; not tested here), no
dropout, no context parallelism: the models that offer this layer (``fused_residual_norm`` in AMPLIFY's, ESM-2's and
Llama's configs) refuse those combinations before building it, and an FP8 recipe other than the three at the first
forward.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


try:  # package import (models/*, exported checkpoints)
    from .fp8_mlp import QuantizedMLP, te_imported
    from .residual_norm import FP8Output, add_layer_norm, add_rms_norm, layer_norm_keep_input, rms_norm_keep_input
    from .te_attention import PackedCuDNNAttention, SplitPackedQKV
except ImportError:  # flat copy inside a recipe folder
    from fp8_mlp import QuantizedMLP, te_imported
    from residual_norm import FP8Output, add_layer_norm, add_rms_norm, layer_norm_keep_input, rms_norm_keep_input
    from te_attention import PackedCuDNNAttention, SplitPackedQKV

try:
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import FP8FwdTensorIdx
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    from transformer_engine.pytorch.distributed import (
        in_fp8_activation_recompute_phase,
        is_fp8_activation_recompute_enabled,
    )
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor
    from transformer_engine.pytorch.utils import init_method_constant
except Exception:  # ImportError, or a broken CUDA install raising at import; the layer refuses to build then
    te = tex = general_gemm = None

# The projections are TE's modules (their parameters, ``_extra_state`` and FP8 scaling state), with forwards of
# their own. Without TE the classes below still import (on nn.Module), but the layer refuses to build.
_TELinear = te.Linear if te is not None else nn.Module
_TELayerNormMLP = te.LayerNormMLP if te is not None else nn.Module

# The FP8 recipes these layers run (all three need Hopper or newer). MXFP8 and NVFP4 (Blackwell) are not tested here.
FP8_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")


NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A parameter in the compute dtype (a differentiable cast: fp32 master weights get their gradient in fp32)."""
    return None if tensor is None else tensor.to(dtype)


def _compute_copy(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A parameter in the compute dtype, inside a Function's forward (where autograd records no cast: the Function's
    backward returns the parameter's gradient in the parameter's own dtype). In that dtype already, the parameter
    itself (FSDP2 and Megatron-FSDP hand over their bf16 compute copies)."""
    return None if param is None else param.to(dtype)


class _SwiGLU(torch.autograd.Function):
    """TE's SwiGLU kernels (``silu(first half) * second half``, as ``te.LayerNormMLP`` runs them)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return tex.swiglu(x, None)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return tex.dswiglu(grad.contiguous(), x, None)


def _weight_and_bias_grad(
    inputs: torch.Tensor,
    grad: torch.Tensor,
    bias: torch.Tensor | None,
    weight_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
):
    """``(grad.T @ inputs, grad.sum(0))`` for a linear layer ``inputs @ weight.T + bias`` (rows: tokens), in the
    parameters' dtypes ``weight_dtype`` and ``bias_dtype``; ``bias`` is the compute-dtype bias of the forward.

    The weight-gradient GEMM writes the parameter's dtype itself: for fp32 master weights (bf16 compute under
    autocast) a float32 output, as TE's ``te.Linear`` writes into its fp32 ``main_grad``. A bf16 output cast to
    float32 afterwards took a rounding and a cast kernel per weight (3 ms of ESM-2 650M's step on one H200).

    cuBLAS can sum the bias gradient inside the weight-gradient GEMM (the BGRADB epilogue; TE's ``te.Linear`` uses it).
    Where the output is wider than the input (QKV, fc1) that made the GEMM slower by more than a separate column sum
    of the gradient takes (one H200, ESM-2 650M at 49,152 tokens: fc1 +0.20 ms against a 0.14 ms sum, QKV +0.16
    against 0.11; 3B at 16,384 tokens: fc1 +0.32 against 0.10; docs/benchmarks.md), so those sum it apart, in float32
    as the epilogue does. For proj and fc2 the epilogue costs less than the sum and stays; it writes the bias
    gradient in the compute dtype (as for TE's fp32 ``main_grad``), cast here where the bias is float32.
    """
    if bias is not None and grad.shape[-1] > inputs.shape[-1]:
        dw, *_ = general_gemm(inputs, grad, out_dtype=weight_dtype, layout="NT", grad=True)
        return dw, grad.sum(0, dtype=torch.float32).to(bias_dtype)
    dw, db, *_ = general_gemm(inputs, grad, out_dtype=weight_dtype, layout="NT", bias=bias, grad=True)
    return dw, None if bias is None else db.to(bias_dtype)


def _dtype(param: torch.Tensor | None) -> torch.dtype | None:
    return None if param is None else param.dtype


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` (the bias may be None) with the bias in the GEMM's epilogue and its gradient by
    ``_weight_and_bias_grad`` (``general_gemm``'s layouts: "TN" forward, "NN" data gradient, "NT" weight gradient, as
    ``te.Linear``). The parameters come as held (fp32 master weights, or already in ``x``'s dtype) and are cast to
    ``x``'s dtype here; their gradients are returned in their own dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        rows = _rows(x)
        compute_weight, compute_bias = _compute_copy(weight, x.dtype), _compute_copy(bias, x.dtype)
        out, *_ = general_gemm(compute_weight, rows, out_dtype=x.dtype, bias=compute_bias)
        # The bias only sets the shape and dtype of its gradient.
        ctx.save_for_backward(rows, compute_weight, compute_bias)
        ctx.input_shape = x.shape
        ctx.param_dtypes = (weight.dtype, _dtype(bias))
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        rows, weight, bias = ctx.saved_tensors
        grad = _rows(grad).contiguous()
        dx, *_ = general_gemm(weight, grad, out_dtype=rows.dtype, layout="NN", grad=True)
        dw, db = _weight_and_bias_grad(rows, grad, bias, *ctx.param_dtypes)
        return dx.view(ctx.input_shape), dw, db


class _GeluMLP(torch.autograd.Function):
    """``fc2(gelu(fc1(x)))`` in two GEMMs: fc1's bias and GELU (tanh) in fc1's epilogue, which also writes the
    pre-activation for the backward; fc2's bias in fc2's. Backward: dGELU in fc2's data-gradient epilogue, fc2's bias
    gradient in its weight-gradient epilogue and fc1's in a column sum (``_weight_and_bias_grad``; ``te.LayerNormMLP``
    in bf16 with ``bias_gelu_nvfusion`` off sums both in the epilogues). The biases may be None. Parameters as in
    ``_Linear``: cast to ``x``'s dtype here, gradients in their own dtypes."""

    @staticmethod
    def forward(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        rows = _rows(x)
        params = (fc1_weight, fc1_bias, fc2_weight, fc2_bias)
        fc1_w, fc1_b, fc2_w, fc2_b = (_compute_copy(param, x.dtype) for param in params)
        activated, _, pre_activation, _ = general_gemm(fc1_w, rows, out_dtype=x.dtype, bias=fc1_b, gelu=True)
        out, *_ = general_gemm(fc2_w, activated, out_dtype=x.dtype, bias=fc2_b)
        ctx.save_for_backward(rows, fc1_w, fc1_b, pre_activation, activated, fc2_w, fc2_b)
        ctx.input_shape = x.shape
        ctx.param_dtypes = tuple(_dtype(param) for param in params)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, fc1_weight, fc1_bias, pre_activation, activated, fc2_weight, fc2_bias = ctx.saved_tensors
        fc1_weight_dtype, fc1_bias_dtype, fc2_weight_dtype, fc2_bias_dtype = ctx.param_dtypes
        grad = _rows(grad).contiguous()
        d_pre_activation, *_ = general_gemm(
            fc2_weight, grad, out_dtype=rows.dtype, layout="NN", grad=True, gelu=True, gelu_in=pre_activation
        )
        fc2_dw, fc2_db = _weight_and_bias_grad(activated, grad, fc2_bias, fc2_weight_dtype, fc2_bias_dtype)
        dx, *_ = general_gemm(fc1_weight, d_pre_activation, out_dtype=rows.dtype, layout="NN", grad=True)
        fc1_dw, fc1_db = _weight_and_bias_grad(rows, d_pre_activation, fc1_bias, fc1_weight_dtype, fc1_bias_dtype)
        return dx.view(ctx.input_shape), fc1_dw, fc1_db, fc2_dw, fc2_db


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None and weight.dtype == x.dtype:
        return F.linear(x, weight)  # torch's GEMM, no epilogue to ask for
    # A bias, or fp32 master weights under bf16 autocast: there F.linear would cast the weight for the GEMM and its
    # bf16 gradient back to float32 (``_weight_and_bias_grad``).
    return _Linear.apply(x, weight, bias)


def _fp8_enabled() -> bool:
    return te is not None and FP8GlobalStateManager.is_fp8_enabled()


def _fp8_recipe_name() -> str:
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    name = type(recipe).__name__
    if name not in FP8_RECIPES:
        raise ValueError(
            f"fused_residual_norm layers run FP8 with {', '.join(FP8_RECIPES)}, not {name}: "
            "set fused_residual_norm=False to use TE's layers"
        )
    return name


def _norm_keep_input(norm, x: torch.Tensor, fp8_output: FP8Output | None = None):
    """``(norm(x), x)`` for a module with TE's norm parameters (``layer_norm_bias`` is None for RMSNorm)."""
    if norm.layer_norm_bias is None:
        return rms_norm_keep_input(x, norm.layer_norm_weight, norm.eps, fp8_output)
    return layer_norm_keep_input(x, norm.layer_norm_weight, norm.layer_norm_bias, norm.eps, fp8_output)


def _add_norm(norm, a: torch.Tensor, residual: torch.Tensor, fp8_output: FP8Output | None = None):
    """``(norm(a + residual), a + residual)``."""
    if norm.layer_norm_bias is None:
        return add_rms_norm(a, residual, norm.layer_norm_weight, norm.eps, fp8_output)
    return add_layer_norm(a, residual, norm.layer_norm_weight, norm.layer_norm_bias, norm.eps, fp8_output)


def _norm_fp8_output(quantizer) -> FP8Output | None:
    """Where the norm's kernel writes its GEMM's FP8 input itself: for a per-tensor scale known before the cast
    (delayed scaling's ``Float8Quantizer``, E4M3), as TE's LayerNorm does in front of an FP8 GEMM. That spares the
    cast's pass over the bf16 output (ESM-2 650M, one H200: norm, cast and transpose 0.203 -> 0.172 ms per norm,
    docs/benchmarks.md). The result is TE's ``Float8Tensor`` with row-wise data only; TE transposes it for the
    weight gradient in backward, as it does its own cast's. Current scaling needs the whole output's amax before
    casting and block scaling its blocks' amaxes, so those get the bf16 output and TE's cast; so does TE's
    activation recompute, whose second forward swaps the scales in the module's own forward, after the norm would
    have run."""
    if not isinstance(quantizer, Float8Quantizer) or quantizer.dtype != tex.DType.kFloat8E4M3:
        return None
    if is_fp8_activation_recompute_enabled() or in_fp8_activation_recompute_phase():
        return None

    def wrap(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return Float8Tensor(
            shape=data.shape,
            dtype=dtype,
            data=data.view(torch.uint8),
            fp8_scale_inv=scale_inv,
            fp8_dtype=quantizer.dtype,
            quantizer=quantizer,
            device=data.device,
        )

    return FP8Output(quantizer.scale, quantizer.amax, wrap)


def _bias(module, name: str = "bias") -> torch.Tensor | None:
    """A TE module's bias parameter, or None (TE keeps an empty tensor under the name when ``bias=False``)."""
    return getattr(module, name) if module.use_bias else None


class NormQKV(_TELinear):
    """``layernorm_qkv``: the norm, then the fused QKV projection. Returns ``(qkv, residual)``.

    ``residual`` is what the layer's residual path adds to attention's output: the input itself, handed back through
    the norm so that its gradient joins the norm's in one backward kernel, or, given ``pending`` (the previous layer's
    last residual, not yet added), the sum ``x + pending``, formed by the norm's kernel.

    A ``te.Linear`` with ``te.LayerNormLinear``'s norm parameters added (the same state-dict keys, and the same FP8
    state for one GEMM): under FP8 autocast the projection is ``te.Linear``'s, on this kernel's normalised output.
    """

    def __init__(self, in_features, out_features, eps, normalization, bias, init_method, params_dtype, device):
        super().__init__(
            in_features, out_features, bias=bias, init_method=init_method, params_dtype=params_dtype, device=device
        )
        self.eps, self.normalization = eps, normalization
        kwargs = {"device": device, "dtype": params_dtype}
        self.register_parameter(
            "layer_norm_weight", nn.Parameter(torch.ones(in_features, **kwargs)), init_fn=init_method_constant(1.0)
        )
        if normalization == "LayerNorm":
            self.register_parameter(
                "layer_norm_bias", nn.Parameter(torch.zeros(in_features, **kwargs)), init_fn=init_method_constant(0.0)
            )
        else:
            self.layer_norm_bias = None

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None = None):
        fp8_output = None
        if _fp8_enabled():
            _fp8_recipe_name()
            # TE's forward initialises the FP8 state too (then a no-op); the norm needs the input quantizer first.
            self.init_fp8_metadata()
            fp8_output = _norm_fp8_output(self.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_INPUT])
        if pending is None:
            normed, residual = _norm_keep_input(self, x, fp8_output)
        else:
            normed, residual = _add_norm(self, x, pending, fp8_output)
        if _fp8_enabled():
            return super().forward(normed), residual
        return _linear(normed, self.weight, _bias(self)), residual


class EpilogueLinear(_TELinear):
    """``proj``: ``te.Linear``; in bf16/fp32 a bias is added (and its gradient summed) by the GEMM epilogues."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fp8_enabled():
            _fp8_recipe_name()
            return super().forward(x)
        return _linear(x, self.weight, _bias(self))


class AddNormMLP(_TELayerNormMLP):
    """``layernorm_mlp``: ``h = attention_out + residual``, the norm, fc1, the activation, fc2. Returns
    ``(mlp_out, h)``. A ``te.LayerNormMLP`` whose forward normalises with this file's kernel; under FP8 autocast the
    GEMMs and activation are ``QuantizedMLP``'s, with this module's quantizers."""

    def forward(self, attention_out: torch.Tensor, residual: torch.Tensor):
        fc1_bias, fc2_bias = _bias(self, "fc1_bias"), _bias(self, "fc2_bias")
        if _fp8_enabled():
            return self._fp8_forward(attention_out, residual, fc1_bias, fc2_bias)
        normed, total = _add_norm(self, attention_out, residual)
        if self.activation == "gelu":
            return _GeluMLP.apply(normed, self.fc1_weight, fc1_bias, self.fc2_weight, fc2_bias), total
        hidden = _SwiGLU.apply(_linear(normed, self.fc1_weight, fc1_bias))
        return _linear(hidden, self.fc2_weight, fc2_bias), total

    def _fp8_forward(self, attention_out, residual, fc1_bias, fc2_bias):
        """``(mlp_out, h)`` under FP8 autocast: the norm, then ``QuantizedMLP`` (see ``_norm_fp8_output`` for when
        the norm writes fc1's FP8 input itself)."""
        _fp8_recipe_name()
        needs_grad = torch.is_grad_enabled()
        attention_out = self.prepare_forward(attention_out, num_gemms=2)
        try:
            quantizers = self._get_quantizers(False, needs_grad)
            normed, total = _add_norm(self, attention_out, residual, _norm_fp8_output(quantizers[0]))
            dtype = self.activation_dtype
            bias_dtype = torch.bfloat16 if dtype == torch.float32 else dtype  # cuBLAS's FP8 GEMMs take no fp32 bias
            fc1_bias, fc2_bias = _cast(fc1_bias, bias_dtype), _cast(fc2_bias, bias_dtype)
            args = (self.fc1_weight, fc1_bias, self.fc2_weight, fc2_bias, quantizers, self.activation, dtype)
            if needs_grad:
                return QuantizedMLP.apply(normed, *args, True), total
            return QuantizedMLP.forward(None, normed, *args, False), total
        finally:
            self.end_forward()


class _SelfAttention(nn.Module):
    """``self_attention``: ``layernorm_qkv`` -> TE's ``core_attention`` -> ``proj`` (TE's module names).

    The projection's output is laid out as TE's interleaved one: per key/value group, its query heads, then its key
    and value heads ([tokens, groups, heads / groups + 2, head_dim]; [tokens, heads, 3, head_dim] without GQA)."""

    def __init__(
        self, hidden_size, num_heads, num_groups, head_dim, eps, mask_type, init_method, output_init, layer_number, kw
    ):
        super().__init__()
        self.num_heads, self.num_groups, self.head_dim, self.mask_type = num_heads, num_groups, head_dim, mask_type
        qkv_size = (num_heads + 2 * num_groups) * head_dim
        self.layernorm_qkv = NormQKV(hidden_size, qkv_size, eps=eps, init_method=init_method, **kw)
        self.core_attention = PackedCuDNNAttention(  # te.DotProductAttention, called without its Python per call
            num_heads,
            head_dim,
            num_gqa_groups=num_groups,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type=mask_type,
            layer_number=layer_number,
        )
        linear_kw = {name: value for name, value in kw.items() if name != "normalization"}
        self.proj = EpilogueLinear(num_heads * head_dim, hidden_size, init_method=output_init, **linear_kw)
        # Under GQA, packed_rope.PackedQKVRotary.attach sets this: the rotation then happens in split_qkv's copy.
        self.qkv_rotary = None

    def split_qkv(self, qkv: torch.Tensor, sizes: list[int] | None = None) -> list[tuple[torch.Tensor, ...]]:
        """(query [tokens, heads, head_dim], key and value [tokens, groups, head_dim]) for TE's attention, one triple
        per range of ``sizes`` consecutive tokens (None: one range, all tokens), as ``attend`` takes them.

        Without GQA they are views of the projection (``SplitPackedQKV``: TE runs its packed-QKV kernels, and their
        gradient is attention's dQKV buffer itself). With GQA a group's query heads are not evenly spaced in the
        buffer, so TE needs them copied out: ``qkv_rotary.rotate_and_split`` rotates queries and keys as it copies
        (one kernel each way, the same bits as rotating in place, then copying and concatenating the gradients; Llama
        1B training +0.7% on one H200, docs/benchmarks.md), each range into tensors of its own, so that the ranges'
        gradients go back into the projection's without first being joined; without a rotary batch, plain copies."""
        tokens, groups, per_group = qkv.shape[0], self.num_groups, self.num_heads // self.num_groups
        sizes = [tokens] if sizes is None else list(sizes)
        if per_group == 1:
            split = SplitPackedQKV.apply(qkv.view(tokens, groups, 3, self.head_dim), -2)
        else:
            # None while the rotary module holds no batch: plain copies below, as without it.
            rotated = self.qkv_rotary.rotate_and_split(qkv, sizes) if self.qkv_rotary is not None else None
            if rotated is not None:  # already one (query, key, value) triple per range
                return [tuple(rotated[index : index + 3]) for index in range(0, len(rotated), 3)]
            query, key, value = qkv.view(tokens, groups, per_group + 2, self.head_dim).split([per_group, 1, 1], dim=2)
            split = (
                query.reshape(tokens, self.num_heads, self.head_dim),
                key.reshape(tokens, groups, self.head_dim).contiguous(),
                value.reshape(tokens, groups, self.head_dim).contiguous(),
            )
        return [tuple(split)] if len(sizes) == 1 else list(zip(*(t.split(sizes) for t in split)))

    def dense_sequences(self, boundaries: dict, leading_full_sequences: int) -> int:
        """How many leading sequences ``attend`` runs as one dense batch: ``leading_full_sequences`` (the first
        sequences, all ``max_seqlen_q`` tokens long) where the batch allows it (self-attention, no padding between
        sequences), else 0."""
        cu_seqlens = boundaries["cu_seqlens_q"]
        self_attention = boundaries["cu_seqlens_kv"] is None or boundaries["cu_seqlens_kv"] is cu_seqlens
        unpadded = boundaries["cu_seqlens_q_padded"] is None and boundaries["cu_seqlens_kv_padded"] is None
        same_length = boundaries["max_seqlen_kv"] == boundaries["max_seqlen_q"]
        return leading_full_sequences if self_attention and unpadded and same_length else 0

    def attend(
        self, parts: list[tuple[torch.Tensor, ...]], boundaries: dict, dense_sequences: int = 0
    ) -> torch.Tensor:
        """Attention over the packed sequences: [tokens, heads * head_dim], from ``split_qkv``'s ``parts``.

        With ``dense_sequences`` = n > 0 (``dense_sequences()``: the first n sequences are ``max_seqlen_q`` tokens
        long) ``parts`` holds their n * max_seqlen_q tokens' query, key and value, then (unless nothing is left)
        those of the rest. The first run as one dense [n, max_seqlen_q] batch (TE's BSHD path; cuDNN 9.14 runs causal
        BSHD ~10% faster than the same work packed, docs/benchmarks.md), the rest as a packed batch of its own; their
        outputs are joined (one copy). Same results as one packed call, up to the order of cuDNN's sums. With n = 0,
        one part: one packed call.
        """
        if not dense_sequences:
            (query, key, value), *more = parts
            if more:
                raise ValueError("attend() takes one part of query, key and value without dense sequences")
            return self.core_attention(
                query, key, value, qkv_format="thd", attn_mask_type=self.mask_type, **boundaries
            )
        n, length = dense_sequences, boundaries["max_seqlen_q"]
        dense_tokens = n * length
        if parts[0][0].shape[0] != dense_tokens or len(parts) > 2:
            raise ValueError(f"attend() takes the {dense_tokens} tokens of {n} dense sequences, then the rest")
        dense = self.core_attention(
            *(t.view(n, length, *t.shape[1:]) for t in parts[0]),
            qkv_format="bshd",
            attn_mask_type="causal" if "causal" in self.mask_type else "no_mask",
        ).view(dense_tokens, -1)
        if len(parts) == 1:
            return dense
        rest_cu_seqlens = boundaries["cu_seqlens_q"][n:] - dense_tokens
        rest = self.core_attention(
            *parts[1],
            qkv_format="thd",
            attn_mask_type=self.mask_type,
            cu_seqlens_q=rest_cu_seqlens,
            cu_seqlens_kv=rest_cu_seqlens,
            max_seqlen_q=length,  # an upper bound for the rest is all TE needs
            max_seqlen_kv=length,
        )
        return torch.cat([dense, rest])


class FusedResidualTransformerLayer(nn.Module):
    """See the module docstring. Takes ``te.TransformerLayer``'s constructor and forward arguments (those that
    AMPLIFY's, ESM-2's and Llama's layers use) and refuses settings it does not implement."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        self_attn_mask_type: str = "padding",
        normalization: str = "RMSNorm",
        activation: str = "swiglu",
        bias: bool = False,
        qkv_weight_interleaved: bool = True,
        attn_input_format: str = "thd",
        params_dtype=None,
        device=None,
        **unused,
    ):
        super().__init__()
        if te is None or not te_imported():
            raise RuntimeError("FusedResidualTransformerLayer needs TransformerEngine (attention, GEMMs, SwiGLU)")
        allowed = {
            "normalization": (normalization, NORMALIZATIONS),
            "activation": (activation, ACTIVATIONS),
            "qkv_weight_interleaved": (qkv_weight_interleaved, (True,)),
            "attn_input_format": (attn_input_format, ("thd",)),
            "self_attn_mask_type": (self_attn_mask_type, ("padding", "padding_causal")),
            "hidden_dropout": (hidden_dropout, (0.0,)),
            "attention_dropout": (attention_dropout, (0.0,)),
        }
        unsupported = [
            f"{name}={value!r} (needs {' or '.join(map(repr, choices))})"
            for name, (value, choices) in allowed.items()
            if value not in choices
        ]
        if unsupported:
            raise ValueError("FusedResidualTransformerLayer does not support " + ", ".join(unsupported))
        num_groups = num_gqa_groups or num_attention_heads
        if num_attention_heads % num_groups:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of num_gqa_groups")
        head_dim = kv_channels or hidden_size // num_attention_heads
        device = "cuda" if device is None else device  # (TE's modules' default)
        kw = {"params_dtype": params_dtype, "device": device, "bias": bias, "normalization": normalization}
        self.self_attention = _SelfAttention(
            hidden_size,
            num_attention_heads,
            num_groups,
            head_dim,
            layernorm_epsilon,
            self_attn_mask_type,
            init_method,
            output_layer_init_method,
            layer_number,
            kw,
        )
        self.layernorm_mlp = AddNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            activation=activation,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            **kw,
        )

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p") -> None:
        if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
            raise ValueError("FusedResidualTransformerLayer does not support context parallelism; use TE's layer")

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        pending_residual: torch.Tensor | None = None,
        defer_residual: bool = False,
        leading_full_sequences: int = 0,
        **unused,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """TE's layer's forward, plus a way to leave the last residual add to the next layer's first norm kernel,
        and ``leading_full_sequences`` (``_SelfAttention.attend``).

        The layer's output is ``mlp_out + h`` (``h`` = the input plus attention's output). With ``defer_residual``
        it returns ``(mlp_out, h)`` unsummed, and the next layer, called with ``hidden_states=mlp_out,
        pending_residual=h``, adds them inside its first norm (one pass over [tokens, hidden] less per layer). Whoever
        receives the pair from the last layer adds it.
        """
        if rotary_pos_emb is not None:
            raise ValueError(
                "FusedResidualTransformerLayer applies no rotary table itself: rotate inside the QKV projection "
                "(packed_rope.PackedQKVRotary) and call it with rotary_pos_emb=None"
            )
        if cu_seqlens_q is None or max_seqlen_q is None:
            raise ValueError(
                "FusedResidualTransformerLayer takes packed (THD) input: pass cu_seqlens_q and max_seqlen_q"
            )
        if torch.is_autocast_enabled(hidden_states.device.type):  # as TE's layer: activations in the autocast dtype
            dtype = torch.get_autocast_dtype(hidden_states.device.type)
            hidden_states = hidden_states.to(dtype)
            pending_residual = pending_residual.to(dtype) if pending_residual is not None else None
        attention = self.self_attention
        qkv, residual = attention.layernorm_qkv(hidden_states, pending_residual)
        boundaries = {
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_kv": cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q,
            "cu_seqlens_q_padded": cu_seqlens_q_padded,
            "cu_seqlens_kv_padded": cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_q_padded,
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_kv": max_seqlen_kv if max_seqlen_kv is not None else max_seqlen_q,
        }
        dense = attention.dense_sequences(boundaries, leading_full_sequences)
        dense_tokens = dense * boundaries["max_seqlen_q"]
        sizes = [size for size in (dense_tokens, qkv.shape[0] - dense_tokens) if size] or None
        context = attention.attend(attention.split_qkv(qkv, sizes), boundaries, dense)
        mlp_out, total = self.layernorm_mlp(attention.proj(context), residual)
        return (mlp_out, total) if defer_residual else total + mlp_out
