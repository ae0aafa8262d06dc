"""residual_rmsnorm.py: RMSNorm with the residual add (forward) and the residual gradient (backward) inside its
Triton kernels. On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1) against plain torch; the layer
built on them is compared with TE's on a GPU (test_fused_residual_layer_gpu.py)."""

import pytest
import torch

from amplify_te import residual_rmsnorm
from amplify_te.modeling_amplify_te import NVAmplifyConfig


pytestmark = pytest.mark.skipif(not residual_rmsnorm.available(), reason="Triton is not installed")

EPS = 1e-5
# 150 rows: not a multiple of the kernels' row tiles (4) and more than one backward program (64 rows each), so the
# row masks and the weight gradient's sum over programs both matter; 96 features: not a power of two (column mask).
ROWS, FEATURES = 150, 96


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """Build the kernels for Triton's CPU interpreter for this test (and forget them afterwards)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(residual_rmsnorm, "_KERNELS", None)


def inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=generator).to(dtype)
    a = torch.randn(ROWS, FEATURES, generator=generator).to(dtype)
    weight = 1 + 0.3 * torch.randn(FEATURES, generator=generator)
    return x, a, weight


def pre_norm_block(norm_keep_input, add_norm, x, a, weight):
    """What a pre-norm layer does with the two functions: y1 = norm(x); h = a' + x; y2 = norm(h); out = h + y2 * c,
    where a' depends on y1 (as attention's output does), so every gradient path of the layer is exercised."""
    y1, residual = norm_keep_input(x, weight)
    attention_out = a * y1
    y2, h = add_norm(attention_out, residual, weight)
    return h + 0.5 * y2


def reference_block(x, a, weight):
    def norm_keep_input(x, w):
        return residual_rmsnorm.rms_norm_reference(x, w, EPS), x

    def add_norm(a, r, w):
        h = a + r
        return residual_rmsnorm.rms_norm_reference(h, w, EPS), h

    return pre_norm_block(norm_keep_input, add_norm, x, a, weight)


def kernel_block(x, a, weight):
    return pre_norm_block(
        lambda x, w: residual_rmsnorm.rms_norm_keep_input(x, w, EPS),
        lambda a, r, w: residual_rmsnorm.add_rms_norm(a, r, w, EPS),
        x,
        a,
        weight,
    )


def test_forward_writes_the_sum_and_its_norm():
    x, a, weight = inputs()
    y, total, rstd = residual_rmsnorm.rms_norm_forward(x, weight, EPS, add=a)
    torch.testing.assert_close(total, x + a, rtol=0, atol=0)
    torch.testing.assert_close(y, residual_rmsnorm.rms_norm_reference(x + a, weight, EPS), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd, torch.rsqrt((x + a).pow(2).mean(-1) + EPS), rtol=1e-6, atol=0)
    y_plain, no_total, _ = residual_rmsnorm.rms_norm_forward(x, weight, EPS)
    assert no_total is None
    torch.testing.assert_close(y_plain, residual_rmsnorm.rms_norm_reference(x, weight, EPS), rtol=1e-6, atol=1e-6)


def test_reference_is_rmsnorm_written_out():
    x, _, weight = inputs()
    row = x[7]
    expected = row / torch.sqrt((row**2).sum() / FEATURES + EPS) * weight
    torch.testing.assert_close(residual_rmsnorm.rms_norm_reference(x, weight, EPS)[7], expected)


def test_every_gradient_equals_plain_torch_in_float32():
    """Input, residual and weight gradients of a pre-norm block, through both functions (the residual gradient that
    the kernels add in must arrive exactly once)."""
    grads = []
    for block in (reference_block, kernel_block):
        x, a, weight = (t.clone().requires_grad_() for t in inputs())
        out = block(x, a, weight)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((out.detach(), x.grad, a.grad, weight.grad))
    for expected, actual, name in zip(grads[0], grads[1], ("output", "x", "a", "weight")):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_strided_input_gives_the_same_numbers():
    """A transposed (non-contiguous) input: outputs and gradients equal those of its contiguous copy."""
    results = []
    for make_strided in (False, True):
        x, a, weight = (t.clone().requires_grad_() for t in inputs())
        source = x.detach().t().contiguous().t().requires_grad_() if make_strided else x
        assert source.is_contiguous() is not make_strided
        out = kernel_block(source, a, weight)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), source.grad, a.grad, weight.grad))
    for expected, actual in zip(*results):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_bfloat16_close_to_plain_torch():
    grads = []
    for block in (reference_block, kernel_block):
        x, a, weight = inputs(torch.bfloat16)
        x, a, weight = x.requires_grad_(), a.requires_grad_(), weight.requires_grad_()
        out = block(x, a, weight)
        out.float().sum().backward()
        grads.append((out.detach(), x.grad, a.grad))
    for expected, actual, name in zip(grads[0], grads[1], ("output", "x", "a")):
        assert actual.dtype == torch.bfloat16
        # Both round every intermediate to bf16 (2^-8 relative), at different points: compare as a whole.
        error = (actual.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (name, error.item())


def test_refuses_mismatched_shapes():
    x, a, weight = inputs()
    with pytest.raises(ValueError, match="one entry per feature"):
        residual_rmsnorm.rms_norm_forward(x, weight[:-1], EPS)
    with pytest.raises(ValueError, match="the residual must be a contiguous tensor shaped like the input"):
        residual_rmsnorm.rms_norm_forward(x, weight, EPS, add=a[:-1])


def test_config_refuses_fp8_layers_with_fused_residual_norm():
    with pytest.raises(ValueError, match="layer_precision must be all None"):
        NVAmplifyConfig(num_hidden_layers=2, fused_residual_norm=True, layer_precision=["fp8", None])
    assert NVAmplifyConfig(num_hidden_layers=2, fused_residual_norm=True).fused_residual_norm
