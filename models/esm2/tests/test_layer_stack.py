"""The layer loop ESM-2 and AMPLIFY share (layer_stack.py) and the rotary choice per pass (packed_rope.py's
``layers_rotary_pos_emb``), on CPU with stand-in layers: what each layer receives, what comes back, where the
activations are recomputed and which autocast regions open. The GPU tests run the same code with TE's layers and the
fused layers (test_fused_residual_layer_gpu.py, test_packed_rope.py)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from esm2_te.layer_autocast import LayerAutocast
from esm2_te.layer_stack import run_layer_stack
from esm2_te.packed_rope import PackedQKVRotary, layers_rotary_pos_emb


class ScaleLayer(nn.Module):
    """``hidden * scale + shift`` (or, deferring, the pair ``(hidden * scale, shift + pending)``, whose sum is the
    same), counting its forward calls and recording the keyword arguments it was given."""

    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))
        self.shift = shift
        self.calls = 0
        self.kwargs = []

    def forward(self, hidden, pending_residual=None, defer_residual=False, **kwargs):
        self.calls += 1
        self.kwargs.append({"pending_residual": pending_residual, "defer_residual": defer_residual, **kwargs})
        if pending_residual is not None:  # the previous layer's unsummed residual
            hidden = hidden + pending_residual
        if defer_residual:
            return hidden * self.scale, torch.full_like(hidden, self.shift)
        return hidden * self.scale + self.shift


def stack(recompute_layers: int = 0, training: bool = True):
    layers = nn.ModuleList(ScaleLayer(scale, shift) for scale, shift in ((2.0, 1.0), (0.5, -3.0), (3.0, 0.25)))
    model = SimpleNamespace(training=training, config=SimpleNamespace(recompute_layers=recompute_layers))
    return model, layers


def no_autocast(layers) -> LayerAutocast:
    return LayerAutocast([None] * len(layers), {}, None)


@pytest.mark.parametrize("defer_residual", [False, True], ids=["summed", "deferred"])
def test_the_stack_returns_the_summed_layers_output_and_every_layers_input(defer_residual):
    model, layers = stack()
    hidden = torch.tensor([[1.0, -2.0]])
    out, all_hidden = run_layer_stack(
        model, layers, hidden, no_autocast(layers), defer_residual, output_hidden_states=True, rotary_pos_emb="table"
    )
    expected_inputs = [hidden]
    for scale, shift in ((2.0, 1.0), (0.5, -3.0), (3.0, 0.25)):
        expected_inputs.append(expected_inputs[-1] * scale + shift)
    torch.testing.assert_close(out, expected_inputs[-1])
    assert len(all_hidden) == 3
    for reported, expected in zip(all_hidden, expected_inputs[:3]):
        torch.testing.assert_close(reported, expected)
    for index, layer in enumerate(layers):
        (kwargs,) = layer.kwargs
        assert kwargs["rotary_pos_emb"] == "table"
        assert kwargs["defer_residual"] is defer_residual
        # the first layer gets no pending residual; each later one gets its predecessor's when deferring
        assert (kwargs["pending_residual"] is not None) == (defer_residual and index > 0)


def test_without_hidden_states_the_stack_reports_none():
    model, layers = stack()
    _, all_hidden = run_layer_stack(model, layers, torch.ones(1, 2), no_autocast(layers), False, False)
    assert all_hidden is None


@pytest.mark.parametrize("defer_residual", [False, True], ids=["summed", "deferred"])
def test_the_first_recompute_layers_run_their_forward_again_in_backward(defer_residual):
    model, layers = stack(recompute_layers=2)
    hidden = torch.tensor([[1.0, -2.0]], requires_grad=True)
    out, _ = run_layer_stack(model, layers, hidden, no_autocast(layers), defer_residual, False)
    out.sum().backward()
    assert [layer.calls for layer in layers] == [2, 2, 1]
    # d out / d hidden = product of the scales, whichever way the residuals were summed
    torch.testing.assert_close(hidden.grad, torch.full_like(hidden, 2.0 * 0.5 * 3.0))


def test_nothing_is_recomputed_outside_training():
    model, layers = stack(recompute_layers=3, training=False)
    out, _ = run_layer_stack(model, layers, torch.ones(1, 2, requires_grad=True), no_autocast(layers), False, False)
    out.sum().backward()
    assert [layer.calls for layer in layers] == [1, 1, 1]


def test_the_autocast_regions_follow_the_layers_precision():
    model, layers = stack()
    events = []

    class Region:
        def __init__(self, enabled, recipe):
            self.entry = (enabled, recipe)

        def __enter__(self):
            events.append(("enter", *self.entry))

        def __exit__(self, *exc):
            events.append(("exit", self.entry[1]))

    autocast = LayerAutocast(["fp8", "fp8", None], {"fp8": "FP8"}, Region)
    run_layer_stack(model, layers, torch.ones(1, 2), autocast, True, False)
    assert events == [("enter", True, "FP8"), ("exit", "FP8"), ("enter", False, None), ("exit", None)]


# ------------------------------------------------------------------------------------------ layers_rotary_pos_emb


class RecordingRotary(PackedQKVRotary):
    def __init__(self):
        super().__init__(num_heads=2, head_dim=8)
        self.batches = []

    def set_batch(self, positions, freqs=None):
        self.batches.append(positions)


def packed(padded: bool):
    positions = torch.tensor([0, 1, 2, 0, 1])
    return SimpleNamespace(cu_seqlens_padded=torch.tensor([0, 4, 8]) if padded else None, positions=lambda: positions)


TABLE = torch.zeros(3, 1, 1, 8)


@pytest.mark.parametrize(
    "fused_qkv_rope, fused_residual_norm, padded, in_projection",
    [
        (True, False, False, True),
        (True, False, True, False),  # context parallelism: TE's RoPE places each rank's shares
        (False, False, False, False),
        (False, True, False, True),  # the fused layers always rotate in the projection
        (True, True, False, True),
    ],
)
def test_the_projection_rotates_where_the_config_asks_and_the_pass_allows(
    fused_qkv_rope, fused_residual_norm, padded, in_projection
):
    rotary = RecordingRotary()
    batch = packed(padded)
    table = layers_rotary_pos_emb(rotary, batch, TABLE, fused_qkv_rope, fused_residual_norm)
    if in_projection:
        assert table is None
        (positions,) = rotary.batches
        assert torch.equal(positions, batch.positions())
    else:
        assert table is TABLE
        assert rotary.batches == [None]  # a previous batch's positions must not rotate this pass


def test_without_a_qkv_rotary_the_layers_get_the_table():
    assert layers_rotary_pos_emb(None, packed(False), TABLE, True, False) is TABLE


def test_fused_layers_refuse_a_pass_that_cannot_rotate_in_the_projection():
    with pytest.raises(ValueError, match="fused_residual_norm layers take packed sequences without per-sequence"):
        layers_rotary_pos_emb(RecordingRotary(), packed(True), TABLE, False, True)


def test_a_setting_that_needs_the_projection_rotary_names_itself_where_it_is_unavailable():
    # half of 24 is not a power of two: no in-projection rotary for this head size (nor, on CPU, without Triton)
    assert PackedQKVRotary.for_layers([], num_heads=2, head_dim=24) is None
    with pytest.raises(ValueError, match=r"fused_residual_norm rotates queries and keys .* half a head \(12\)"):
        PackedQKVRotary.for_layers([], num_heads=2, head_dim=24, required_by="fused_residual_norm")
