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
