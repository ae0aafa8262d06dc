"""residual_norm.py: RMSNorm and LayerNorm with the residual add (forward) and the residual gradient (backward) inside
their Triton kernels. On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1) against plain torch; the
layers built on them are compared with TE's on a GPU (test_fused_residual_layer_gpu.py here for AMPLIFY's RMSNorm
layer, models/esm2's for ESM-2's LayerNorm layer). One copy of the kernels serves both models (ci/check_copies.py)."""

import pytest
import torch

from amplify_te import residual_norm
from amplify_te.modeling_amplify_te import NVAmplifyConfig


pytestmark = pytest.mark.skipif(not residual_norm.available(), reason="Triton is not installed")

EPS = 1e-5
# 150 rows: not a multiple of the kernels' row tiles (4) and more than one backward program (64 rows each), so the
# row masks and the weight gradient's sum over programs both matter; 96 features: not a power of two (column mask).
ROWS, FEATURES = 150, 96
NORMS = ("RMSNorm", "LayerNorm")


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """Build the kernels for Triton's CPU interpreter for this test (and forget them afterwards)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(residual_norm, "_KERNELS", None)


def inputs(norm, dtype=torch.float32, seed=0):
    """x, a, weight, bias (None for RMSNorm). The inputs have a nonzero mean per row, so LayerNorm's centring
    matters."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(ROWS, FEATURES, generator=generator) + 0.7).to(dtype)
    a = torch.randn(ROWS, FEATURES, generator=generator).to(dtype)
    weight = 1 + 0.3 * torch.randn(FEATURES, generator=generator)
    bias = 0.2 * torch.randn(FEATURES, generator=generator) if norm == "LayerNorm" else None
    return x, a, weight, bias


def reference_norm(x, weight, bias):
    if bias is None:
        return residual_norm.rms_norm_reference(x, weight, EPS)
    return residual_norm.layer_norm_reference(x, weight, bias, EPS)


def pre_norm_block(norm_keep_input, add_norm, x, a, weight, bias):
    """What a pre-norm layer does with the two functions: y1 = norm(x); h = a' + x; y2 = norm(h); out = h + y2 * c,
    where a' depends on y1 (as attention's output does), so every gradient path of the layer is exercised."""
    y1, residual = norm_keep_input(x, weight, bias)
    attention_out = a * y1
    y2, h = add_norm(attention_out, residual, weight, bias)
    return h + 0.5 * y2


def reference_block(x, a, weight, bias):
    def norm_keep_input(x, w, b):
        return reference_norm(x, w, b), x

    def add_norm(a, r, w, b):
        h = a + r
        return reference_norm(h, w, b), h

    return pre_norm_block(norm_keep_input, add_norm, x, a, weight, bias)


def kernel_block(x, a, weight, bias):
    if bias is None:
        return pre_norm_block(
            lambda x, w, b: residual_norm.rms_norm_keep_input(x, w, EPS),
            lambda a, r, w, b: residual_norm.add_rms_norm(a, r, w, EPS),
            x,
            a,
            weight,
            bias,
        )
    return pre_norm_block(
        lambda x, w, b: residual_norm.layer_norm_keep_input(x, w, b, EPS),
        lambda a, r, w, b: residual_norm.add_layer_norm(a, r, w, b, EPS),
        x,
        a,
        weight,
        bias,
    )


@pytest.mark.parametrize("norm", NORMS)
def test_forward_writes_the_sum_and_its_norm(norm):
    x, a, weight, bias = inputs(norm)
    y, total, mean, rstd = residual_norm.norm_forward(x, weight, bias, EPS, add=a)
    torch.testing.assert_close(total, x + a, rtol=0, atol=0)
    torch.testing.assert_close(y, reference_norm(x + a, weight, bias), rtol=1e-6, atol=1e-6)
    h = x + a
    if norm == "LayerNorm":
        torch.testing.assert_close(mean, h.mean(-1), rtol=1e-6, atol=1e-6)
        h = h - h.mean(-1, keepdim=True)
    else:
        assert mean is None
    torch.testing.assert_close(rstd, torch.rsqrt(h.pow(2).mean(-1) + EPS), rtol=1e-6, atol=0)
    y_plain, no_total, _, _ = residual_norm.norm_forward(x, weight, bias, EPS)
    assert no_total is None
    torch.testing.assert_close(y_plain, reference_norm(x, weight, bias), rtol=1e-6, atol=1e-6)


def test_references_are_the_norms_written_out():
    x, _, weight, bias = inputs("LayerNorm")
    row = x[7]
    expected = row / torch.sqrt((row**2).sum() / FEATURES + EPS) * weight
    torch.testing.assert_close(residual_norm.rms_norm_reference(x, weight, EPS)[7], expected)
    torch.testing.assert_close(
        residual_norm.layer_norm_reference(x, weight, bias, EPS),
        torch.nn.functional.layer_norm(x, (FEATURES,), weight, bias, EPS),
    )


@pytest.mark.parametrize("norm", NORMS)
def test_every_gradient_equals_plain_torch_in_float32(norm):
    """Input, residual, weight (and bias) gradients of a pre-norm block, through both functions (the residual
    gradient that the kernels add in must arrive exactly once)."""
    grads = []
    for block in (reference_block, kernel_block):
        x, a, weight, bias = (t.clone().requires_grad_() if t is not None else None for t in inputs(norm))
        out = block(x, a, weight, bias)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((out.detach(), x.grad, a.grad, weight.grad, bias.grad if bias is not None else None))
    for expected, actual, name in zip(grads[0], grads[1], ("output", "x", "a", "weight", "bias")):
        if expected is None:
            assert actual is None, name
            continue
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_wide_rows_get_fewer_rows_per_tile_and_more_warps():
    """Four rows on four warps up to 2,048 values per row (ESM-2 650M, AMPLIFY: the tiles these kernels were first
    measured with), then more warps, and from 4,097 one row per tile (ESM-2 3B: 2,560, 15B: 5,120)."""
    tiles = {features: residual_norm._tile(features) for features in (96, 640, 960, 1280, 2048, 2560, 4096, 5120)}
    assert tiles == {
        96: (128, 4, 4),
        640: (1024, 4, 4),
        960: (1024, 4, 4),
        1280: (2048, 4, 4),
        2048: (2048, 4, 4),
        2560: (4096, 4, 8),
        4096: (4096, 4, 8),
        5120: (8192, 1, 16),
    }


@pytest.mark.parametrize("tile_rows", [1, 2])
@pytest.mark.parametrize("norm", NORMS)
def test_tiles_of_fewer_rows_give_the_same_numbers(monkeypatch, norm, tile_rows):
    """The kernels with one or two rows per tile (each backward program then loops over 64 or 32 tiles), as wide rows
    run them, on narrow rows here: the interpreter would take minutes over tiles of thousands of columns. The GPU
    test (test_residual_norm_gpu.py) runs the real widths compiled."""
    monkeypatch.setattr(
        residual_norm, "_tile", lambda num_cols: (residual_norm.triton.next_power_of_2(num_cols), tile_rows, 8)
    )
    grads = []
    for block in (reference_block, kernel_block):
        x, a, weight, bias = (t.clone().requires_grad_() if t is not None else None for t in inputs(norm))
        out = block(x, a, weight, bias)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((out.detach(), x.grad, a.grad, weight.grad, bias.grad if bias is not None else None))
    for expected, actual, name in zip(grads[0], grads[1], ("output", "x", "a", "weight", "bias")):
        if expected is not None:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("norm", NORMS)
def test_partial_sums_over_several_blocks_give_the_same_numbers(monkeypatch, norm):
    """The weight (and bias) gradient's last kernel sums the backward programs' partial sums in blocks of
    _FINALIZE_PARTIALS partials by _FINALIZE_COLS features. With 4 rows per program (38 partials for 150 rows) and
    blocks of 8 partials by 64 features, it loops over 5 blocks, the last one partial, in two column blocks, the last
    one partial (96 features)."""
    monkeypatch.setattr(residual_norm, "_BACKWARD_ROWS", 4)
    monkeypatch.setattr(residual_norm, "_FINALIZE_PARTIALS", 8)
    monkeypatch.setattr(residual_norm, "_FINALIZE_COLS", 64)
    grads = []
    for block in (reference_block, kernel_block):
        x, a, weight, bias = (t.clone().requires_grad_() if t is not None else None for t in inputs(norm))
        out = block(x, a, weight, bias)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((weight.grad, bias.grad if bias is not None else None))
    for expected, actual, name in zip(grads[0], grads[1], ("weight", "bias")):
        if expected is not None:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("norm", NORMS)
def test_a_bfloat16_weight_gets_its_gradient_in_bfloat16(norm):
    """The last kernel rounds the float32 sums to the weight's dtype, as ``.to(weight.dtype)`` did: for a bf16 weight
    (and bias), ``norm_backward``'s gradients are bf16 and equal plain torch's float32 sums rounded to bf16, to one
    bf16 step (the sums run in another order)."""
    x, _, weight, bias = inputs(norm)
    weight = weight.to(torch.bfloat16)
    bias = bias.to(torch.bfloat16) if bias is not None else None
    dy = torch.linspace(-1, 1, x.numel()).view_as(x)
    _, _, mean, rstd = residual_norm.norm_forward(x, weight, bias, EPS)
    _, weight_grad, bias_grad = residual_norm.norm_backward(dy, x, weight, mean, rstd)
    centered = x - x.mean(-1, keepdim=True) if bias is not None else x
    x_hat = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + EPS)
    expected = {"weight": (dy * x_hat).sum(0), "bias": dy.sum(0) if bias is not None else None}
    for name, actual in (("weight", weight_grad), ("bias", bias_grad)):
        if expected[name] is None:
            assert actual is None
            continue
        assert actual.dtype == torch.bfloat16, name
        rounded = expected[name].to(torch.bfloat16).float()
        torch.testing.assert_close(actual.float(), rounded, rtol=2**-7, atol=1e-5, msg=name)


@pytest.mark.parametrize("norm", NORMS)
def test_strided_input_gives_the_same_numbers(norm):
    """A transposed (non-contiguous) input: outputs and gradients equal those of its contiguous copy."""
    results = []
    for make_strided in (False, True):
        x, a, weight, bias = (t.clone().requires_grad_() if t is not None else None for t in inputs(norm))
        source = x.detach().t().contiguous().t().requires_grad_() if make_strided else x
        assert source.is_contiguous() is not make_strided
        out = kernel_block(source, a, weight, bias)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), source.grad, a.grad, weight.grad))
    for expected, actual in zip(*results):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_bfloat16_close_to_plain_torch(norm):
    grads = []
    for block in (reference_block, kernel_block):
        x, a, weight, bias = inputs(norm, torch.bfloat16)
        x, a, weight = x.requires_grad_(), a.requires_grad_(), weight.requires_grad_()
        out = block(x, a, weight, bias)
        out.float().sum().backward()
        grads.append((out.detach(), x.grad, a.grad))
    for expected, actual, name in zip(grads[0], grads[1], ("output", "x", "a")):
        assert actual.dtype == torch.bfloat16
        # Both round every intermediate to bf16 (2^-8 relative), at different points: compare as a whole.
        error = (actual.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (name, error.item())


def test_refuses_mismatched_shapes():
    x, a, weight, bias = inputs("LayerNorm")
    with pytest.raises(ValueError, match="weight .* one entry per feature"):
        residual_norm.norm_forward(x, weight[:-1], None, EPS)
    with pytest.raises(ValueError, match="bias .* one entry per feature"):
        residual_norm.norm_forward(x, weight, bias[:-1], EPS)
    with pytest.raises(ValueError, match="the residual must be a contiguous tensor shaped like the input"):
        residual_norm.norm_forward(x, weight, None, EPS, add=a[:-1])


def fp8_output(scale: float, amax: float = 0.0):
    """An ``FP8Output`` whose ``wrap`` keeps what the kernel wrote and returns it dequantised (so a loss can take it
    and send its gradient back through the norm)."""
    written = {}

    def wrap(data, scale_inv, dtype):
        written.update(data=data, scale_inv=scale_inv, dtype=dtype)
        return data.to(dtype) * scale_inv

    return residual_norm.FP8Output(torch.tensor([scale]), torch.tensor([amax]), wrap), written


def fp8_codes_match(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per value: the E4M3 codes are equal or neighbours (float32 sums in another order can round a value sitting on
    a rounding boundary the other way). Triton's CPU interpreter also loses the carry when a value rounds up into the
    next power of two (124.5 -> 64 rather than 128) and rounds subnormals (below 2^-6) wrongly; those are faults of
    the interpreter, not of the GPU's conversion, which the GPU test checks, so they count as matching here."""
    a, e = actual.view(torch.uint8).int(), expected.view(torch.uint8).int()
    neighbours = (a - e).abs() <= 1
    interpreter_carry = (actual.float() * 2 == expected.float()) & (expected.view(torch.uint8) & 0x07 == 0)
    interpreter_subnormal = (expected.float().abs() < 2**-6) & (actual.float().abs() < 2**-6)
    return neighbours | interpreter_carry | interpreter_subnormal


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("scale", [3.0, 400.0])
def test_fp8_output_is_the_scaled_norm_in_e4m3(norm, scale):
    """``y * scale`` saturated at 448 and rounded to E4M3, the amax raised to the largest |y| (never lowered), and
    1 / scale beside the data; at scale 400 over a fifth of the values saturate."""
    x, a, weight, bias = inputs(norm)
    expected_y = reference_norm(x + a, weight, bias)
    for start_amax, expected_amax in ((0.0, expected_y.abs().max()), (100.0, torch.tensor(100.0))):
        output, written = fp8_output(scale, start_amax)
        y, total, _, _ = residual_norm.norm_forward(x, weight, bias, EPS, add=a, fp8_output=output)
        torch.testing.assert_close(total, x + a, rtol=0, atol=0)
        torch.testing.assert_close(output.amax[0], expected_amax, rtol=1e-6, atol=0)
        data = written["data"]
        assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and written["dtype"] == x.dtype
        assert torch.equal(written["scale_inv"], torch.tensor([1 / scale]))  # correctly rounded, as TE's
        expected = (expected_y * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        matches = fp8_codes_match(data, expected)
        assert matches.all(), (data[~matches][:8], expected[~matches][:8])
        exact = (data.view(torch.uint8) == expected.view(torch.uint8)).float().mean()
        assert exact > 0.9, exact
        saturated = (expected_y * scale).abs() >= 448
        assert (data.float()[saturated].abs() == 448).all()
        if scale == 400.0:
            assert saturated.float().mean() > 0.2
        torch.testing.assert_close(y, data.to(x.dtype) / scale)


@pytest.mark.parametrize("norm", NORMS)
def test_fp8_output_gradients_are_those_of_the_plain_output(norm):
    """The gradient that reaches an FP8 output (in the activation dtype) goes back through the same backward kernel:
    for the same output gradient, every input's gradient equals the plain path's."""
    grads = []
    for use_fp8 in (False, True):
        x, a, weight, bias = (t.clone().requires_grad_() if t is not None else None for t in inputs(norm))
        output = fp8_output(2.0)[0] if use_fp8 else None
        if bias is None:
            y1, residual = residual_norm.rms_norm_keep_input(x, weight, EPS, fp8_output=output)
            y2, h = residual_norm.add_rms_norm(a, residual, weight, EPS, fp8_output=output)
        else:
            y1, residual = residual_norm.layer_norm_keep_input(x, weight, bias, EPS, fp8_output=output)
            y2, h = residual_norm.add_layer_norm(a, residual, weight, bias, EPS, fp8_output=output)
        gradient = torch.linspace(-1, 1, x.numel()).view_as(x)
        ((y1 + y2) * gradient).sum().add(h.sum()).backward()
        grads.append([t.grad for t in (x, a, weight, bias) if t is not None])
    for plain, fp8 in zip(*grads):
        torch.testing.assert_close(fp8, plain, rtol=0, atol=0)


def test_fp8_output_amax_leaves_out_the_padding_rows():
    """Rows past the end of the input (the last program's tile) are not outputs: a LayerNorm whose every output is
    zero (each row the same +-1 pattern, the bias cancelling it) must leave the amax at zero, where a padding row's
    output would be the bias itself."""
    pattern = torch.tensor([1.0, -1.0]).repeat(FEATURES // 2)
    x = pattern.repeat(ROWS, 1)  # 150 rows: the last program's tile has padding rows
    weight, bias = torch.full((FEATURES,), 3.0), -3.0 * pattern
    output, written = fp8_output(2.0)
    residual_norm.norm_forward(x, weight, bias, EPS, fp8_output=output)
    assert output.amax.item() < 1e-4
    assert written["data"].float().abs().max() < 1e-3


def test_fp8_output_refuses_a_scale_that_is_not_one_float32():
    x, _, weight, _ = inputs("RMSNorm")
    output, _ = fp8_output(2.0)
    with pytest.raises(ValueError, match="the FP8 scale must be one float32 value"):
        residual_norm.norm_forward(x, weight, None, EPS, fp8_output=output._replace(scale=torch.ones(2)))
    with pytest.raises(ValueError, match="the FP8 amax must be one float32 value"):
        residual_norm.norm_forward(x, weight, None, EPS, fp8_output=output._replace(amax=torch.ones(1).double()))


def test_config_refuses_fp4_layers_with_fused_residual_norm():
    with pytest.raises(ValueError, match="layer_precision entries must be None or 'fp8'"):
        NVAmplifyConfig(num_hidden_layers=2, fused_residual_norm=True, layer_precision=["fp4", None])
    assert NVAmplifyConfig(num_hidden_layers=2, fused_residual_norm=True).fused_residual_norm
    assert NVAmplifyConfig(
        num_hidden_layers=2, fused_residual_norm=True, layer_precision=["fp8", None]
    ).fused_residual_norm
