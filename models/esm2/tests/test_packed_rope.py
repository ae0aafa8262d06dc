"""packed_rope.py: rotary embeddings applied in place to a packed QKV projection (one Triton kernel each way).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) against a plain-torch rotation; on a GPU the
whole model with the kernel must give TE's own RoPE path's numbers (ESM-2 here, AMPLIFY in models/amplify)."""

import pytest
import torch
from esm_testing import hf_esm2_config, model_inputs, randomize_
from transformers import EsmForMaskedLM

from esm2_te import packed_rope
from esm2_te.convert import convert_esm_hf_to_te


pytestmark = pytest.mark.skipif(not packed_rope.available(), reason="Triton is not installed")

HEADS, HEAD_DIM = 5, 16  # 5 heads: not a power of two, so the kernel's head mask matters


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """Build the kernel for Triton's CPU interpreter for this test (and forget it afterwards)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(packed_rope, "_KERNEL", None)


def tables(max_position: int = 8, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cos(angles), torch.sin(angles)


# Three packed sequences of 4, 3 and 4 tokens: positions restart at every sequence.
POSITIONS = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3])


def test_forward_rotates_query_and_key_in_the_buffer_and_leaves_value(interpreted_kernel):
    cos, sin = tables()
    qkv = torch.randn(len(POSITIONS), 3 * HEADS * HEAD_DIM)
    expected = packed_rope.rotate_query_key_reference(qkv, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    buffer = qkv.clone()
    out = packed_rope.rotate_query_key_(buffer, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    assert out.data_ptr() == buffer.data_ptr()  # no new buffer
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)  # the projection's own buffer holds the result
    value = qkv.view(-1, HEADS, 3, HEAD_DIM)[:, :, 2]
    assert torch.equal(out.view(-1, HEADS, 3, HEAD_DIM)[:, :, 2], value)
    first_tokens = POSITIONS == 0  # angle 0: nothing turns
    assert torch.equal(out[first_tokens], qkv[first_tokens])


def test_reference_is_the_half_split_rotation_of_each_head():
    """The reference against the rotary formula written out: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cos, sin = tables()
    qkv = torch.randn(len(POSITIONS), 3 * HEADS * HEAD_DIM)
    out = packed_rope.rotate_query_key_reference(qkv, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    token, head, half = 5, 3, HEAD_DIM // 2
    c, s = cos[POSITIONS[token]], sin[POSITIONS[token]]
    for block in (0, 1):  # query, key
        x = qkv.view(-1, HEADS, 3, HEAD_DIM)[token, head, block]
        want = torch.cat([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])
        torch.testing.assert_close(out.view(-1, HEADS, 3, HEAD_DIM)[token, head, block], want)


def test_bf16_buffer_matches_the_float32_rotation_rounded_once(interpreted_kernel):
    """Within one bf16 step: the interpreter's float32 -> bf16 conversion need not round as the GPU does."""
    cos, sin = tables()
    qkv = torch.randn(len(POSITIONS), 3 * HEADS * HEAD_DIM).to(torch.bfloat16)
    expected = packed_rope.rotate_query_key_reference(qkv, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    out = packed_rope.rotate_query_key_(qkv.clone(), POSITIONS, cos, sin, HEADS, HEAD_DIM)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-6)


class _ViewFromAFunction(torch.autograd.Function):
    """Returns its input's rows as a view made inside the Function, as TE's QKV projection returns its output: autograd
    refuses an ordinary in-place operation on such a view, which is why ``rotate_query_key_`` works through ``detach``."""

    @staticmethod
    def forward(ctx, x):
        return (x * 1.0).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_backward_behind_a_view_from_a_function_is_the_transposed_rotation(interpreted_kernel):
    """Behind a Function that returns a view (TE's projection), the forward and the input's gradient equal the
    plain-torch rotation's; the incoming gradient buffer is rotated in place (it is attention's dQKV, used by nobody
    else)."""
    cos, sin = tables()
    qkv = torch.randn(len(POSITIONS), 3 * HEADS * HEAD_DIM)
    grad = torch.randn_like(qkv)

    leaf = qkv.clone().requires_grad_(True)
    projected = _ViewFromAFunction.apply(leaf)
    with pytest.raises(RuntimeError, match="view"):  # what the plain in-place route would hit
        projected.mul_(1.0)
    out = packed_rope.rotate_query_key_(projected, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    incoming = grad.clone()
    out.backward(incoming)

    reference_leaf = qkv.clone().requires_grad_(True)
    reference = packed_rope.rotate_query_key_reference(reference_leaf, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    reference.backward(grad)
    torch.testing.assert_close(out.detach(), reference.detach(), rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, reference_leaf.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(incoming, reference_leaf.grad, rtol=1e-6, atol=1e-6)  # rotated where it lay


def test_bad_buffers_are_refused_with_their_shape(interpreted_kernel):
    cos, sin = tables()
    with pytest.raises(ValueError, match=r"contiguous \[tokens, 3 \* 5 \* 16\] QKV buffer, got \(11, 200\)"):
        packed_rope.rotate_query_key_(torch.zeros(11, 200), POSITIONS, cos, sin, HEADS, HEAD_DIM)
    strided = torch.zeros(11, 2 * 3 * HEADS * HEAD_DIM)[:, ::2]
    with pytest.raises(ValueError, match="contiguous: False"):
        packed_rope.rotate_query_key_(strided, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="one entry per token"):
        packed_rope.rotate_query_key_(torch.zeros(11, 240), POSITIONS[:5], cos, sin, HEADS, HEAD_DIM)


@pytest.mark.parametrize(("head_dim", "supported"), [(64, True), (128, True), (32, True), (96, False), (7, False)])
def test_head_sizes_the_kernel_takes(head_dim, supported):
    assert packed_rope.supports(head_dim) is supported


class _FakeAttention(torch.nn.Module):
    def __init__(self, width: int, return_tuple: bool = False):
        super().__init__()
        self.layernorm_qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.return_tuple = return_tuple


class _FakeLayer(torch.nn.Module):
    """Only the part of a TE layer the hook touches: self_attention.layernorm_qkv."""

    def __init__(self, width: int):
        super().__init__()
        self.self_attention = _FakeAttention(width)


def test_hook_rotates_projection_outputs_only_while_a_batch_is_set(interpreted_kernel):
    layers = torch.nn.ModuleList([_FakeLayer(HEADS * HEAD_DIM) for _ in range(2)])
    rotary = packed_rope.PackedQKVRotary.for_layers(layers, HEADS, HEAD_DIM)
    projection = layers[1].self_attention.layernorm_qkv
    hidden = torch.randn(len(POSITIONS), HEADS * HEAD_DIM)
    plain = hidden @ projection.weight.T
    assert torch.equal(projection(hidden), plain)  # no batch set: untouched

    cos, sin = tables()
    freqs = torch.cat([torch.atan2(sin, cos)] * 2, dim=-1)[:, None, None, :]  # TE's [seq, 1, 1, head_dim] table
    rotary.set_batch(POSITIONS, freqs)
    expected = packed_rope.rotate_query_key_reference(plain, POSITIONS, cos, sin, HEADS, HEAD_DIM)
    torch.testing.assert_close(projection(hidden), expected, rtol=1e-5, atol=1e-6)

    rotary.set_batch(None)
    assert torch.equal(projection(hidden), plain)


def test_no_rotary_object_where_the_head_size_does_not_fit():
    layers = torch.nn.ModuleList([_FakeLayer(3 * 12)])
    assert packed_rope.PackedQKVRotary.for_layers(layers, 3, 12) is None  # half of 12 is not a power of two


SHAPE = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512}


@pytest.mark.requires_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_esm2_with_rope_in_the_projection_equals_te_rope(input_format, recompute):
    """Logits, loss and every gradient with the kernel (the default) against TE's RoPE, in bf16 on the GPU; also with
    every layer of the kernel's model recomputed in backward (the rotation's batch must still hold then)."""
    torch.manual_seed(0)
    hf_model = randomize_(EsmForMaskedLM(hf_esm2_config(**SHAPE)))
    models = {flag: convert_esm_hf_to_te(hf_model, backend="te", fused_qkv_rope=flag).cuda() for flag in (True, False)}
    assert models[True].esm.encoder.qkv_rotary is not None
    layer_calls = count_layer_calls(models[True].esm.encoder.layers)
    if recompute:  # no dropout in this config, so training mode changes nothing but the recompute
        models[True].train().config.recompute_layers = SHAPE["num_hidden_layers"]
    batch = model_inputs(input_format)
    outputs = {}
    for flag, model in models.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs[flag] = model(**batch)
        outputs[flag].loss.backward()
    assert outputs[True].loss.item() == pytest.approx(outputs[False].loss.item(), rel=2e-3)
    logits_error = (outputs[True].logits - outputs[False].logits).float().norm() / outputs[False].logits.float().norm()
    assert logits_error < 1e-2
    reference = dict(models[False].named_parameters())
    for name, param in models[True].named_parameters():
        if param.grad is None:
            assert reference[name].grad is None, name
            continue
        error = (param.grad - reference[name].grad).float().norm() / reference[name].grad.float().norm().clamp(
            min=1e-12
        )
        assert error < 2e-2, (name, error.item())
    assert layer_calls == [2 if recompute else 1] * SHAPE["num_hidden_layers"]


def count_layer_calls(layers: torch.nn.ModuleList) -> list[int]:
    """A list that counts each layer's forward calls from now on (a recomputed layer runs twice per step)."""
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
    return calls
