"""residual_norm.py's compiled kernels on a GPU, in each of the tiles ``_tile`` picks by row width (four rows on four
warps up to 2,048 values, four rows on eight warps up to 4,096, one row on sixteen warps beyond): every output and
gradient of a pre-norm block equals plain torch's in float32. test_residual_norm.py checks the same on CPU in
Triton's interpreter, which does not compile the kernels and so cannot show what a tile does on the hardware."""

import pytest
import torch

from amplify_te import residual_norm


pytestmark = [
    pytest.mark.requires_gpu,
    pytest.mark.skipif(not residual_norm.available(), reason="Triton is not installed"),
]

EPS = 1e-5


def block(x, a, weight, bias, fused: bool):
    """norm(x) -> (a * y1 + x) -> norm -> h + y2 / 2: every kernel and gradient path of a pre-norm layer."""
    if fused:
        if bias is None:
            y1, residual = residual_norm.rms_norm_keep_input(x, weight, EPS)
            y2, h = residual_norm.add_rms_norm(a * y1, residual, weight, EPS)
        else:
            y1, residual = residual_norm.layer_norm_keep_input(x, weight, bias, EPS)
            y2, h = residual_norm.add_layer_norm(a * y1, residual, weight, bias, EPS)
        return h + 0.5 * y2
    if bias is None:
        norm = lambda t: residual_norm.rms_norm_reference(t, weight, EPS)  # noqa: E731
    else:
        norm = lambda t: residual_norm.layer_norm_reference(t, weight, bias, EPS)  # noqa: E731
    h = a * norm(x) + x
    return h + 0.5 * norm(h)


# 1,000 rows: several backward programs of 64 rows and a partial last one. Widths: ESM-2 650M's 1,280, 3B's 2,560 and
# 15B's 5,120, and one of each tile that is not a power of two.
@pytest.mark.parametrize("features", [1280, 2560, 3000, 5120, 6000])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_every_tile_equals_plain_torch_on_the_gpu(norm, features):
    generator = torch.Generator(device="cuda").manual_seed(features)
    leaves = {
        "x": torch.randn(1000, features, device="cuda", generator=generator) + 0.7,
        "a": torch.randn(1000, features, device="cuda", generator=generator),
        "weight": 1 + 0.3 * torch.randn(features, device="cuda", generator=generator),
    }
    if norm == "LayerNorm":
        leaves["bias"] = 0.2 * torch.randn(features, device="cuda", generator=generator)
    upstream = torch.randn(1000, features, device="cuda", generator=generator)
    results = []
    for fused in (False, True):
        tensors = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        out = block(tensors["x"], tensors["a"], tensors["weight"], tensors.get("bias"), fused)
        out.backward(upstream)
        results.append({"output": out.detach(), **{name: t.grad for name, t in tensors.items()}})
    expected, actual = results
    for name in expected:
        # float32 throughout; the weight and bias gradients sum 1,000 rows in another order
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("features", [1280, 2560, 5120])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_fp8_output_is_the_scaled_norm_rounded_once_on_the_gpu(norm, features):
    """The FP8 output (delayed scaling) on the hardware's conversion: E4M3 codes of ``y * scale`` saturated at 448,
    rounded once from float32, equal to torch's conversion of plain torch's float32 norm (neighbouring codes allowed
    where the two float32 results straddle a rounding boundary, at most 0.1% of values); the amax is the largest |y|
    and 1 / scale is correctly rounded. bf16 input and weights, as in training."""
    generator = torch.Generator(device="cuda").manual_seed(features)
    x = (torch.randn(1000, features, device="cuda", generator=generator) + 0.7).bfloat16()
    a = torch.randn(1000, features, device="cuda", generator=generator).bfloat16()
    weight = (1 + 0.3 * torch.randn(features, device="cuda", generator=generator)).bfloat16()
    bias = (
        (0.2 * torch.randn(features, device="cuda", generator=generator)).bfloat16() if norm == "LayerNorm" else None
    )
    h = (x.float() + a.float()).bfloat16().float()
    if bias is None:
        expected_y = residual_norm.rms_norm_reference(h, weight.float(), EPS)
    else:
        expected_y = residual_norm.layer_norm_reference(h, weight.float(), bias.float(), EPS)
    written = {}

    def wrap(data, scale_inv, dtype):
        written.update(data=data, scale_inv=scale_inv, dtype=dtype)
        return data

    for scale in (3.0, 200.0):  # at 200 a part of the values saturate
        amax = torch.zeros(1, device="cuda")
        output = residual_norm.FP8Output(torch.tensor([scale], device="cuda"), amax, wrap)
        _, total, _, _ = residual_norm.norm_forward(a, weight, bias, EPS, add=x, fp8_output=output)
        assert torch.equal(total, (x + a))
        torch.testing.assert_close(amax[0], expected_y.abs().max(), rtol=1e-5, atol=0)
        assert torch.equal(written["scale_inv"].cpu(), torch.tensor([1 / scale]))
        assert written["dtype"] == torch.bfloat16
        expected = (expected_y * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        codes, expected_codes = written["data"].view(torch.uint8).int(), expected.view(torch.uint8).int()
        assert (codes - expected_codes).abs().max() <= 1
        assert (codes != expected_codes).float().mean() < 1e-3
        if scale == 200.0:
            assert (written["data"].float().abs() == 448).float().mean() > 0.01
