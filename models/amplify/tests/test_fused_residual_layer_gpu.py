"""AMPLIFY with ``fused_residual_norm=True`` (fused_residual_layer.py: residual adds inside Triton RMSNorm kernels)
gives the numbers of TE's ``TransformerLayer`` with the same weights, has the same state-dict keys, and trains with
recompute and from a meta-device init. The kernels are tested on CPU in test_residual_norm.py."""

import pytest
import torch
from amplify_testing import make_batch, reference_model, reference_to_nv
from model_contract import pack

from amplify_te.fused_residual_layer import FusedResidualTransformerLayer
from amplify_te.modeling_amplify_te import NVAmplifyForMaskedLM
from amplify_te.packed_rope import PackedQKVRotary


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]

# 15 heads of 64 as AMPLIFY 350M (a head count that is not a power of two), hidden 960 (not a power of two either).
SHAPE = {"num_hidden_layers": 2, "hidden_size": 960, "num_attention_heads": 15, "intermediate_size": 1920}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).float().norm() / expected.float().norm().clamp(min=1e-12)).item()


def run(model, batch, autocast: bool):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        output = model(**batch)
    output.loss.backward()
    return output


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
@pytest.mark.parametrize("precision", ["bf16-autocast", "fp32"])
def test_fused_residual_layers_equal_te_layers(precision, input_format, recompute):
    reference = reference_model(SHAPE)
    fused = reference_to_nv(reference, backend="te", fused_residual_norm=True).cuda().train()
    plain = reference_to_nv(reference, backend="te", fused_qkv_rope=True).cuda().train()
    assert all(isinstance(layer, FusedResidualTransformerLayer) for layer in fused.amplify.layers)
    assert not any(isinstance(layer, FusedResidualTransformerLayer) for layer in plain.amplify.layers)
    assert sorted(fused.state_dict()) == sorted(plain.state_dict())  # checkpoints load either way
    fused.config.recompute_layers = SHAPE["num_hidden_layers"] if recompute else 0
    batch = make_batch([200, 130, 77, 250, 31])
    batch = pack(batch) if input_format == "thd" else batch
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    autocast = precision == "bf16-autocast"
    out_fused, out_plain = run(fused, batch, autocast), run(plain, batch, autocast)
    # bf16: a few roundings apart per layer; fp32: the same math in another order and precision of accumulation
    # (TE's kernels and GEMM settings vs Triton's and torch's), 1e-5 apart in the loss.
    loss_tolerance, logits_tolerance, grad_tolerance = (2e-3, 1e-2, 2e-2) if autocast else (1e-4, 1e-3, 1e-2)
    assert out_fused.loss.item() == pytest.approx(out_plain.loss.item(), rel=loss_tolerance)
    assert relative_error(out_fused.logits, out_plain.logits) < logits_tolerance
    plain_params = dict(plain.named_parameters())
    for name, param in fused.named_parameters():
        expected = plain_params[name].grad
        assert param.grad is not None and expected is not None, name
        assert relative_error(param.grad, expected) < grad_tolerance, (name, relative_error(param.grad, expected))


def test_deferred_residual_chain_gives_the_summed_layers_numbers():
    """Two layers chained with ``defer_residual`` (the second adds the first's last residual inside its first norm)
    give what the layers give one after the other, forward and backward; the hidden states a model reports are the
    summed layer inputs."""
    torch.manual_seed(0)
    layers = [FusedResidualTransformerLayer(960, 1280, 15, layer_number=i + 1, device="cuda") for i in range(2)]
    rotary = PackedQKVRotary.for_layers(layers, 15, 64)
    lengths = torch.tensor([200, 130, 77], dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).cuda()
    boundaries = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens, "max_seqlen_q": 200, "max_seqlen_kv": 200}
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).cuda()
    freqs = torch.randn(200, 1, 1, 64, device="cuda")
    x = torch.randn(int(lengths.sum()), 960, device="cuda")
    grad = torch.randn_like(x)
    results = []
    for deferred in (False, True):
        rotary.set_batch(positions, freqs)
        leaf = x.clone().requires_grad_(True)
        if deferred:
            mlp_out, residual = layers[0](leaf, **boundaries, defer_residual=True)
            assert mlp_out.shape == residual.shape == x.shape
            out = layers[1](mlp_out, **boundaries, pending_residual=residual)
        else:
            out = layers[1](layers[0](leaf, **boundaries), **boundaries)
        out.backward(grad)
        grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
        for layer in layers:
            layer.zero_grad()
        results.append((out.detach(), leaf.grad, grads))
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_b, dx_a, rtol=1e-5, atol=1e-6)
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(grad_b, grad_a, rtol=1e-5, atol=1e-6)


def test_fused_model_reports_the_hidden_states_of_te_layers():
    reference = reference_model(SHAPE)
    fused = reference_to_nv(reference, backend="te", fused_residual_norm=True).cuda().eval()
    plain = reference_to_nv(reference, backend="te", fused_qkv_rope=True).cuda().eval()
    batch = {k: v.cuda() for k, v in make_batch([200, 130, 77]).items()}
    with torch.no_grad():
        states_fused = fused(**batch, output_hidden_states=True).hidden_states
        states_plain = plain(**batch, output_hidden_states=True).hidden_states
    assert len(states_fused) == len(states_plain) == SHAPE["num_hidden_layers"] + 1
    for index, (actual, expected) in enumerate(zip(states_fused, states_plain, strict=True)):
        assert relative_error(actual, expected) < 1e-3, (index, relative_error(actual, expected))


def test_fused_residual_layers_train_from_a_meta_device_init():
    config = reference_to_nv(reference_model(SHAPE), backend="te", fused_residual_norm=True).config
    with torch.device("meta"):
        model = NVAmplifyForMaskedLM(config)
    model.init_empty_weights()
    layer = model.amplify.layers[0]
    assert torch.equal(layer.self_attention.layernorm_qkv.layer_norm_weight, torch.ones(960, device="cuda"))
    weight = layer.layernorm_mlp.fc1_weight
    assert weight.abs().max() <= config.decoder_init_range and weight.std() > 0.5 * config.initializer_range
    model.train()
    batch = {k: v.cuda() for k, v in make_batch([120, 64]).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # learns the one batch


def test_fused_residual_layer_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="does not support attention_dropout=0.1"):
        FusedResidualTransformerLayer(960, 1280, 15, attention_dropout=0.1, device="cuda")
    with pytest.raises(ValueError, match=r"activation='relu' \(needs 'swiglu' or 'gelu'\)"):
        FusedResidualTransformerLayer(960, 1280, 15, activation="relu", device="cuda")


def test_fp32_weights_under_autocast_get_gradients_finer_than_bf16():
    """fp32 master weights under bf16 autocast (the recipes' DDP default): the bias-free projections (QKV, proj, the
    SwiGLU fc1, fc2) run TE's GEMMs, whose weight-gradient GEMMs write float32 gradients themselves, not bf16 ones
    cast up (what ``F.linear`` under autocast gives, and what these layers gave before). Every GEMM weight of every
    layer: >90% of its gradient values lie off the bf16 grid (bf16 values cast up: none)."""
    fused = reference_to_nv(reference_model(SHAPE), backend="te", fused_residual_norm=True).cuda().train()
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in pack(make_batch([200, 130, 77])).items()}
    run(fused, batch, autocast=True)
    checked = 0
    for name, param in fused.amplify.layers.named_parameters():
        if param.dim() != 2:
            continue
        assert param.grad.dtype == torch.float32, name
        off_bf16_values = (param.grad != param.grad.bfloat16().float()).float().mean().item()
        assert off_bf16_values > 0.9, (name, off_bf16_values)
        checked += 1
    assert checked == 4 * SHAPE["num_hidden_layers"]  # QKV, proj, fc1, fc2
