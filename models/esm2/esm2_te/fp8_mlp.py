# Copied from common/fp8_mlp.py — edit the source, then run ci/check_copies.py --fix
"""TE's FP8 MLP without its norm, ``fc2(act(fc1(x)))`` for an input that arrives normalised: the MLP of the fused
residual layers (fused_residual_layer.py) under TE's FP8 autocast, with ``DelayedScaling``, ``Float8CurrentScaling``
or ``Float8BlockScaling``. See ``QuantizedMLP``."""

import torch


try:
    import transformer_engine.pytorch  # noqa: F401  (loads TE's extension, transformer_engine_torch, first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    from transformer_engine.pytorch.module.base import _2X_ACC_DGRAD, _2X_ACC_FPROP, _2X_ACC_WGRAD, quantize_weight
    from transformer_engine.pytorch.module.linear import _check_fp8_reduce_and_update
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    from transformer_engine.pytorch.quantized_tensor import prepare_for_saving, restore_from_saved
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor
except Exception:  # ImportError, or a broken CUDA install raising at import; the fused layers refuse to build then
    tex = general_gemm = None


def te_imported() -> bool:
    """Whether TE's FP8 pieces imported (the fused layers refuse to build without them, rather than fail at the first
    FP8 forward)."""
    return general_gemm is not None


# Under delayed scaling, GELU (tanh) runs in fc1's FP8 GEMM's epilogue; False runs TE's GELU kernel after the GEMM,
# as the other recipes do (tests compare the two).
GELU_IN_FC1_EPILOGUE = True


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _split_accumulator(recipe, gemm: str, default: bool) -> bool:
    settings = getattr(recipe, f"fp8_gemm_{gemm}", None)
    return settings.use_split_accumulator if settings is not None else default


def _quantized_grad_and_bias_grad(grad: torch.Tensor, quantizer, with_bias: bool):
    """``(quantizer(grad), grad.sum(0) or None)``: one fused kernel (``tex.bgrad_quantize``) for per-tensor scaling;
    block scaling has no fused bias gradient in TE, so the sum is apart (as ``te.LayerNormMLP`` does)."""
    quantizer.set_usage(rowwise=True, columnwise=True)
    if not with_bias:
        return quantizer(grad), None
    if isinstance(quantizer, Float8BlockQuantizer):
        return quantizer(grad), grad.sum(0)
    bias_grad, quantized = tex.bgrad_quantize(grad, quantizer)
    return quantized, bias_grad


class QuantizedMLP(torch.autograd.Function):
    """``fc2(act(fc1(x)))`` with FP8 GEMMs, for an input that arrives normalised (from the fused layer's norm kernel),
    in the activation dtype or already in FP8 (fused_residual_layer.py's ``_norm_fp8_output``).

    The FP8 branch of TE 2.20's ``_LayerNormMLP`` without its norm, and without what these layers never use (tensor or
    sequence parallelism, userbuffers, delayed weight gradients, CPU offload, debug quantizers, FP8 weights cached
    across micro-batches): fc1's bias in its GEMM; the activation writes fc2's FP8 input in the same kernel (block
    scaling: a separate cast, as TE), and under delayed scaling GELU runs in fc1's GEMM's epilogue, which writes
    fc2's FP8 input itself (``GELU_IN_FC1_EPILOGUE``, TE's ``gemm_gelu_fusion``); in backward the output gradient's
    cast also sums fc2's bias gradient (``tex.bgrad_quantize``), and dGELU, fc1's bias gradient and the cast are one
    kernel under delayed scaling (``tex.dbias_dgelu``; other recipes: dGELU, then the fused cast and sum). The
    quantizers are the module's (``te.LayerNormMLP._get_quantizers``), so its FP8 scaling state and
    ``_extra_state`` are TE's."""

    @staticmethod
    def forward(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, quantizers, activation, dtype, needs_grad):
        (fc1_input_q, fc1_weight_q, _, _, _, fc1_grad_q, fc2_input_q, fc2_weight_q, _, _, _, fc2_grad_q) = quantizers
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if isinstance(x, Float8Tensor):  # written in FP8 by the norm (``_norm_fp8_output``)
            rows_fp8 = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        else:
            fc1_input_q.set_usage(rowwise=True, columnwise=needs_grad)
            rows_fp8 = fc1_input_q(_rows(x))
        weights_fp8 = []
        for weight, quantizer in ((fc1_weight, fc1_weight_q), (fc2_weight, fc2_weight_q)):
            quantizer.set_usage(rowwise=True, columnwise=needs_grad)
            weight_fp8, _ = quantize_weight(tensor=weight, quantizer=quantizer, workspace_dtype=dtype)
            weight_fp8.update_usage(rowwise_usage=True)
            weights_fp8.append(weight_fp8)
        fc1_weight_fp8, fc2_weight_fp8 = weights_fp8
        split = _split_accumulator(recipe, "fprop", _2X_ACC_FPROP)
        if activation == "gelu" and GELU_IN_FC1_EPILOGUE and isinstance(fc2_input_q, Float8Quantizer):
            # Delayed scaling: fc1's GEMM adds the bias, applies GELU and writes fc2's FP8 input (cuBLASLt records
            # its amax), keeping the pre-activation in bf16 for dGELU (TE's ``gemm_gelu_fusion``). That spares the
            # GELU kernel's pass over [tokens, ffn] (ESM-2 650M, one H200: fc1 and GELU 0.81-0.87 -> 0.75-0.76 ms
            # per layer, docs/benchmarks.md). TE transposes the FP8 output for fc2's weight gradient in backward, as
            # it does the GELU kernel's.
            fc2_input_q.set_usage(rowwise=True, columnwise=False)
            hidden_fp8, _, fc1_out, _ = general_gemm(
                fc1_weight_fp8,
                rows_fp8,
                out_dtype=dtype,
                quantization_params=fc2_input_q,
                bias=fc1_bias,
                gelu=True,
                use_split_accumulator=split,
            )
        else:
            fc1_out, *_ = general_gemm(
                fc1_weight_fp8, rows_fp8, out_dtype=dtype, bias=fc1_bias, use_split_accumulator=split
            )
            act = tex.gelu if activation == "gelu" else tex.swiglu
            if isinstance(fc2_input_q, Float8BlockQuantizer):  # TE's activation kernels cannot write block-scaled FP8
                hidden_fp8 = tex.quantize(act(fc1_out, None), fc2_input_q)
            else:
                hidden_fp8 = act(fc1_out, fc2_input_q)
        out, *_ = general_gemm(fc2_weight_fp8, hidden_fp8, out_dtype=dtype, bias=fc2_bias, use_split_accumulator=split)
        if needs_grad:
            tensors, ctx.tensor_objects = prepare_for_saving(
                rows_fp8, fc1_weight_fp8, fc1_out, hidden_fp8, fc2_weight_fp8
            )
            ctx.save_for_backward(*tensors)
            ctx.quantizers = (fc1_grad_q, fc2_grad_q)
            ctx.recipe, ctx.activation, ctx.dtype, ctx.input_shape = recipe, activation, dtype, x.shape
            ctx.with_bias = fc1_bias is not None, fc2_bias is not None
            # The first FP8 module of the forward runs last in backward and then updates every backward scale.
            ctx.reduce_and_update_backward_scales = _check_fp8_reduce_and_update()
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        rows_fp8, fc1_weight_fp8, fc1_out, hidden_fp8, fc2_weight_fp8 = restore_from_saved(
            ctx.tensor_objects, ctx.saved_tensors
        )
        ctx.tensor_objects = None
        fc1_grad_q, fc2_grad_q = ctx.quantizers
        recipe, dtype = ctx.recipe, ctx.dtype
        dgrad_split = _split_accumulator(recipe, "dgrad", _2X_ACC_DGRAD)
        wgrad_split = _split_accumulator(recipe, "wgrad", _2X_ACC_WGRAD)
        # The weight-gradient GEMMs' ``grad`` flag (TE sets it off for block scaling, whose GEMMs take no epilogue).
        wgrad_flag = not recipe.float8_block_scaling()
        fc1_with_bias, fc2_with_bias = ctx.with_bias

        grad_fp8, fc2_bias_grad = _quantized_grad_and_bias_grad(_rows(grad).contiguous(), fc2_grad_q, fc2_with_bias)
        fc2_weight_fp8.update_usage(columnwise_usage=True)
        hidden_grad, *_ = general_gemm(
            fc2_weight_fp8, grad_fp8, out_dtype=dtype, layout="NN", grad=True, use_split_accumulator=dgrad_split
        )
        hidden_fp8.update_usage(columnwise_usage=True)
        grad_fp8.update_usage(columnwise_usage=True)
        fc2_weight_grad, *_ = general_gemm(
            hidden_fp8, grad_fp8, out_dtype=dtype, layout="NT", grad=wgrad_flag, use_split_accumulator=wgrad_split
        )

        if ctx.activation == "gelu" and (recipe.delayed() or recipe.mxfp8()):
            fc1_grad_q.set_usage(rowwise=True, columnwise=True)
            fc1_bias_grad, fc1_out_grad_fp8 = tex.dbias_dgelu(hidden_grad, fc1_out, fc1_grad_q)
        else:
            dact = tex.dgelu if ctx.activation == "gelu" else tex.dswiglu
            fc1_out_grad_fp8, fc1_bias_grad = _quantized_grad_and_bias_grad(
                dact(hidden_grad, fc1_out, None), fc1_grad_q, fc1_with_bias
            )
        fc1_weight_fp8.update_usage(columnwise_usage=True)
        input_grad, *_ = general_gemm(
            fc1_weight_fp8,
            fc1_out_grad_fp8,
            out_dtype=dtype,
            layout="NN",
            grad=True,
            use_split_accumulator=dgrad_split,
        )
        rows_fp8.update_usage(columnwise_usage=True)
        fc1_out_grad_fp8.update_usage(columnwise_usage=True)
        fc1_weight_grad, *_ = general_gemm(
            rows_fp8,
            fc1_out_grad_fp8,
            out_dtype=dtype,
            layout="NT",
            grad=wgrad_flag,
            use_split_accumulator=wgrad_split,
        )
        if ctx.reduce_and_update_backward_scales:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return (
            input_grad.view(ctx.input_shape),
            fc1_weight_grad,
            fc1_bias_grad if fc1_with_bias else None,
            fc2_weight_grad,
            fc2_bias_grad if fc2_with_bias else None,
            None,
            None,
            None,
            None,
        )
