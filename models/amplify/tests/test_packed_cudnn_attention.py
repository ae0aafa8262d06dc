"""te_attention.packed_layout: which of TE's layout names query, key and value have, for the two layouts the fused
layers hand attention; anything else is left to TE's own path. The direct cuDNN call itself needs a GPU
(test_packed_cudnn_attention_gpu.py)."""

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
