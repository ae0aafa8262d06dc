"""te_attention.py: query, key and value as views of the packed QKV projection, with a copy-free backward.

The pre-hook and the split run on CPU with a stand-in for TE's attention; on a GPU Geneformer with TE layers must
train exactly as without the hook (tests/test_te_attention_gpu.py)."""

import pytest
import torch

from geneformer_te import te_attention


TOKENS, HEADS, DIM = 5, 4, 8


def test_split_gives_the_three_slices_as_views():
    packed = torch.randn(TOKENS, HEADS, 3, DIM)
    query, key, value = te_attention.SplitPackedQKV.apply(packed, -2)
    for index, part in enumerate((query, key, value)):
        assert torch.equal(part, packed.select(2, index))
        assert part.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()  # no copy


def test_backward_returns_the_gradient_buffer_itself_when_the_slices_lie_side_by_side():
    packed = torch.randn(TOKENS, HEADS, 3, DIM, requires_grad=True)
    parts = te_attention.SplitPackedQKV.apply(packed, -2)
    grad_buffer = torch.randn(TOKENS, HEADS, 3, DIM)  # as attention's backward writes dQKV: one buffer
    seen = {}

    def keep(grad):
        seen["grad"] = grad
        return grad

    packed.register_hook(keep)
    torch.autograd.backward(parts, [grad_buffer.select(2, index) for index in range(3)])
    assert torch.equal(packed.grad, grad_buffer)
    assert seen["grad"].data_ptr() == grad_buffer.data_ptr()  # the same memory: nothing was copied


def test_backward_stacks_gradients_that_are_separate_tensors():
    packed = torch.randn(TOKENS, 3, HEADS, DIM, requires_grad=True)  # the other TE layout: [tokens, 3, heads, dim]
    parts = te_attention.SplitPackedQKV.apply(packed, -3)
    grads = [torch.randn(TOKENS, HEADS, DIM) for _ in range(3)]
    torch.autograd.backward(parts, grads)
    assert torch.equal(packed.grad, torch.stack(grads, dim=1))


def test_backward_matches_autograd_through_select():
    packed = torch.randn(TOKENS, HEADS, 3, DIM, requires_grad=True)
    reference = packed.detach().clone().requires_grad_(True)
    weights = [torch.randn(TOKENS, HEADS, DIM) for _ in range(3)]
    sum(w * p for w, p in zip(weights, te_attention.SplitPackedQKV.apply(packed, 2))).sum().backward()
    sum(w * reference.select(2, i) for i, w in enumerate(weights)).sum().backward()
    torch.testing.assert_close(packed.grad, reference.grad, rtol=0, atol=0)


def test_overlapping_slices_are_never_taken_for_one_buffer():
    base = torch.randn(TOKENS * HEADS * DIM + 2)
    overlapping = [base.as_strided((TOKENS, HEADS, DIM), (HEADS * DIM, DIM, 1), offset) for offset in (0, 1, 2)]
    assert te_attention._side_by_side(overlapping, 2) is None


class DotProductAttention(torch.nn.Module):
    """Stands in for TE's: records what it is called with (the class name is what split_packed_qkv looks for)."""

    def forward(self, query_layer, key_layer, value_layer, qkv_format="thd", qkv_layer=None, qkv_interleave_dim=-3):
        self.called_with = (query_layer, key_layer, value_layer, qkv_layer)
        return query_layer * key_layer + value_layer


class OldDotProductAttention(torch.nn.Module):
    """A TE release without packed inputs."""

    def forward(self, query_layer, key_layer, value_layer, qkv_format="thd"):
        return query_layer


def test_pre_hook_passes_query_key_value_instead_of_the_packed_tensor():
    layers = torch.nn.ModuleList([torch.nn.ModuleDict({"attention": DotProductAttention()}) for _ in range(2)])
    assert te_attention.split_packed_qkv(layers) == 2
    attention = layers[0]["attention"]
    packed = torch.randn(TOKENS, HEADS, 3, DIM, requires_grad=True)
    out = attention(None, None, None, qkv_format="thd", qkv_layer=packed, qkv_interleave_dim=-2)
    query, key, value, qkv_layer = attention.called_with
    assert qkv_layer is None and torch.equal(key, packed[:, :, 1])
    out.sum().backward()
    torch.testing.assert_close(packed.grad, torch.stack([key, query, torch.ones_like(value)], dim=2).detach())

    separate = [torch.randn(TOKENS, HEADS, DIM) for _ in range(3)]
    attention(*separate)  # no packed input: passed through untouched
    assert all(a is b for a, b in zip(attention.called_with[:3], separate))


def test_releases_without_packed_inputs_are_left_alone():
    layers = torch.nn.ModuleList([torch.nn.ModuleDict({"attention": OldDotProductAttention()})])
    assert te_attention.split_packed_qkv(layers) == 0


@pytest.mark.parametrize("shape", [(TOKENS, HEADS, 3, DIM), (TOKENS, 3, HEADS, DIM)])
def test_both_te_layouts_round_trip(shape):
    dim = shape.index(3)
    packed = torch.randn(shape, requires_grad=True)
    parts = te_attention.SplitPackedQKV.apply(packed, dim)
    grad = torch.randn(shape)
    torch.autograd.backward(parts, [grad.select(dim, i) for i in range(3)])
    assert torch.equal(packed.grad, grad)
