"""te_attention.packed_layout: which of TE's layout names query, key and value have, for the two layouts the fused
layers hand attention; anything else is left to TE's own path. The direct cuDNN call itself needs a GPU
(test_packed_cudnn_attention_gpu.py)."""

import pytest
import torch

from amplify_te import te_attention


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
