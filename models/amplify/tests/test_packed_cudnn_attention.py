"""te_attention.packed_layout: which of TE's layout names query, key and value have, for the two layouts the fused
layers hand attention; anything else is left to TE's own path. The direct cuDNN call itself needs a GPU
(test_packed_cudnn_attention_gpu.py)."""

import pytest
import torch

from amplify_te import te_attention, te_attention_backward


TOKENS, HEADS, DIM = 7, 3, 8


def test_views_of_one_th3d_buffer_are_named_th3d():
    packed = torch.randn(TOKENS, HEADS, 3, DIM)
    assert te_attention.packed_layout(*te_attention.SplitPackedQKV.apply(packed, -2)) == "th3d"


def test_three_contiguous_tensors_are_named_thd_thd_thd_whatever_their_head_counts():
    query = torch.randn(TOKENS, 4 * HEADS, DIM)  # grouped-query attention: fewer key/value heads
    key, value = torch.randn(TOKENS, HEADS, DIM), torch.randn(TOKENS, HEADS, DIM)
    assert te_attention.packed_layout(query, key, value) == "thd_thd_thd"


def test_other_layouts_are_left_to_te():
    t3hd = torch.randn(TOKENS, 3, HEADS, DIM)
    assert te_attention.packed_layout(*t3hd.unbind(1)) is None  # [t, 3, h, d] views: not a layout handled here
    packed = torch.randn(TOKENS, HEADS, 3, DIM)
    query, key, value = packed.unbind(2)
    assert te_attention.packed_layout(query, value, key) is None  # key and value swapped
    assert te_attention.packed_layout(query, key, value.clone()) is None  # value not in the buffer
    assert te_attention.packed_layout(query[:, :2], key[:, :2], value[:, :2]) is None  # strides of a wider buffer
    batched = torch.randn(2, TOKENS, HEADS, DIM)  # BSHD
    assert te_attention.packed_layout(batched, batched, batched) is None


# What TE 2.20's MultiheadAttention passes its attention on every call of the layers this project builds.
TE_LAYER_ARGUMENTS = {
    "window_size": (-1, -1),
    "softcap": 0.0,
    "bottom_right_diagonal": True,
    "thd_attention_policies": None,
    "thd_attention_policy_dispatch": "auto",
    "checkpoint_core_attention": False,
    "core_attention_bias_type": "no_bias",
    "core_attention_bias": None,
    "alibi_slopes": None,
    "fast_zero_fill": True,
    "inference_params": None,
    "pad_between_seqs": None,
    "fp8_output": False,
    "qkv_layer": None,
    "kv_layer": None,
    "qkv_interleave_dim": -3,
}


def test_the_arguments_te_layers_pass_ask_for_nothing_more():
    assert te_attention.neutral_arguments(TE_LAYER_ARGUMENTS, "padding")
    causal = {**TE_LAYER_ARGUMENTS, "window_size": (-1, 0), "bottom_right_diagonal": False}
    assert te_attention.neutral_arguments(causal, "padding_causal")
    assert te_attention.neutral_arguments({}, "padding")  # the fused layers' own call


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("window_size", (64, 64)),  # a sliding window
        ("bottom_right_diagonal", True),  # with a causal mask: another diagonal
        ("softcap", 30.0),
        ("thd_attention_policies", [{"window_size": (8, 8)}]),
        ("thd_attention_policy_dispatch", "grouped"),
        ("checkpoint_core_attention", True),
        ("core_attention_bias_type", "post_scale_bias"),
        ("core_attention_bias", torch.zeros(1)),
        ("alibi_slopes", torch.zeros(HEADS)),
        ("fast_zero_fill", False),
        ("inference_params", object()),
        ("pad_between_seqs", True),
        ("fp8_output", True),
        ("qkv_layer", torch.zeros(TOKENS, HEADS, 3, DIM)),
        ("kv_layer", torch.zeros(TOKENS, HEADS, 2, DIM)),
        ("score_mod", lambda score, *_: score),  # an argument this module does not know
    ],
)
def test_an_argument_that_asks_for_more_takes_te_path(name, value):
    arguments = {**TE_LAYER_ARGUMENTS, "window_size": (-1, 0), "bottom_right_diagonal": False, name: value}
    assert not te_attention.neutral_arguments(arguments, "padding_causal")


# --------------------------------------------------------------------------- te_attention_backward (its CPU parts)


@pytest.fixture
def interpreted_tail_kernel(monkeypatch):
    """The tail kernel built for Triton's CPU interpreter for this test (and forgotten afterwards)."""
    if te_attention_backward.triton is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(te_attention_backward, "_TAIL_KERNEL", None)


@pytest.mark.parametrize(("rows", "width", "end"), [(37, 15, 25), (37, 15, 37), (37, 15, 0), (33, 1100, 17)])
def test_rows_after_the_last_sequence_are_zeroed_and_no_others(rows, width, end, interpreted_tail_kernel):
    """Blocks of 16 rows, one wholly before the end, one across it, one after; a width over one block of columns."""
    tensor = torch.randn(rows, 3, width) + 5.0  # no zeros to begin with
    before = tensor.clone()
    cu_seqlens = torch.tensor([0, end // 2, end], dtype=torch.int32)
    te_attention_backward.zero_rows_after_last_sequence(tensor, cu_seqlens)
    assert torch.equal(tensor[:end], before[:end])
    assert not tensor[end:].any()


def test_the_tail_kernel_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        te_attention_backward.zero_rows_after_last_sequence(torch.zeros(4, 3, 2)[:, 0], torch.tensor([0, 2]))


def test_unfilled_gradients_lie_as_the_inputs_do():
    """th3d: dQ, dK, dV are views of one [tokens, heads, 3, head_dim] buffer, side by side as ``SplitPackedQKV``'s
    backward hands them on without a copy; thd_thd_thd: three contiguous tensors of the inputs' shapes."""
    query, key, value = te_attention.SplitPackedQKV.apply(torch.randn(TOKENS, HEADS, 3, DIM), -2)
    buffers, gradients = te_attention_backward.empty_gradients(query, key, value, "th3d")
    assert len(buffers) == 1 and buffers[0].shape == (TOKENS, HEADS, 3, DIM)
    assert te_attention.packed_layout(*gradients) == "th3d"
    assert te_attention._side_by_side(list(gradients), 2).data_ptr() == buffers[0].data_ptr()
    query, key, value = (
        torch.randn(TOKENS, 4 * HEADS, DIM),
        torch.randn(TOKENS, HEADS, DIM),
        torch.randn(TOKENS, HEADS, DIM),
    )
    buffers, gradients = te_attention_backward.empty_gradients(query, key, value, "thd_thd_thd")
    assert [g.shape for g in gradients] == [query.shape, key.shape, value.shape]
    assert all(g.is_contiguous() and b is g for b, g in zip(buffers, gradients, strict=True))
    with pytest.raises(ValueError, match="t3hd"):
        te_attention_backward.empty_gradients(query, key, value, "t3hd")


def test_without_te_the_backward_without_fill_is_not_offered():
    if te_attention_backward.transformer_engine is not None:
        pytest.skip("TE is installed here")
    assert not te_attention_backward.available()
