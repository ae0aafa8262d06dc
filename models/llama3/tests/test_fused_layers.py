"""Llama with ``fused_residual_norm=True``: ``FusedResidualTransformerLayer`` with grouped-query, causal attention and
the queries and keys rotated inside the QKV projection's buffer (packed_rope.py).

On CPU: the rotation kernel (in Triton's interpreter) on the grouped layout against the model's own split and RoPE,
and the config's refusals. On a GPU: the fused model gives TE's layers' numbers with the same weights (loss, logits,
every gradient; BSHD and THD; with recompute), decodes through the KV cache as the full forward does, and trains
from a meta-device init.
"""

import pytest
import torch
from llama_testing import (
    GPU_SHAPE,
    LLAMA3_ROPE,
    TINY_GQA_SHAPE,
    hf_llama_config,
    make_batch,
    randomize_,
    relative_error,
)
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from llama3_te import packed_rope, te_attention
from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.llama_decoding import split_fused_qkv
from llama3_te.modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM, NVLlamaRotaryEmbedding
from llama3_te.torch_layers import apply_rotary_pos_emb


# Three packed sequences of 4, 3 and 5 tokens: positions restart at every sequence.
LENGTHS = [4, 3, 5]
POSITIONS = torch.cat([torch.arange(n) for n in LENGTHS])
CU_SEQLENS = torch.tensor([0, 4, 7, 12])


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """Build the kernel for Triton's CPU interpreter for this test (and forget it afterwards)."""
    if not packed_rope.available():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(packed_rope, "_KERNEL", None)
    monkeypatch.setattr(packed_rope, "_SPLIT_KERNEL", None)


def _config(**overrides) -> NVLlamaConfig:
    return NVLlamaConfig(**{**TINY_GQA_SHAPE, "vocab_size": 256, "backend": "torch", **overrides})


@pytest.mark.parametrize(("heads", "groups"), [(8, 2), (6, 3), (4, 4), (5, 1)], ids=["4-per-group", "2", "mha", "mqa"])
def test_kernel_rotates_the_grouped_projection_as_the_model_rotates_its_split(interpreted_kernel, heads, groups):
    """In place, on the [tokens, groups * (heads / groups + 2) * head_dim] buffer of TE's interleaved GQA projection:
    the query and key heads come out as the model's own split (``split_fused_qkv``) rotated by its torch RoPE, with
    positions restarting at each sequence; the value heads are not touched."""
    head_dim = 16
    config = _config(
        num_attention_heads=heads,
        num_key_value_heads=groups,
        hidden_size=heads * head_dim,
        rope_parameters=LLAMA3_ROPE,
    )
    rotary = config_rotary_table(config, max(LENGTHS))
    cos, sin = rotary_halves(rotary)
    qkv = torch.randn(len(POSITIONS), (heads + 2 * groups) * head_dim)
    buffer = qkv.clone()
    out = packed_rope.rotate_query_key_(buffer, POSITIONS, cos, sin, heads, head_dim, groups)
    assert out.data_ptr() == buffer.data_ptr()

    q, k, v = split_fused_qkv(qkv, config)
    q_out, k_out, v_out = split_fused_qkv(out, config)
    torch.testing.assert_close(q_out, apply_rotary_pos_emb(q, rotary, "thd", cu_seqlens=CU_SEQLENS))
    torch.testing.assert_close(k_out, apply_rotary_pos_emb(k, rotary, "thd", cu_seqlens=CU_SEQLENS))
    assert torch.equal(v_out, v)
    reference = packed_rope.rotate_query_key_reference(qkv, POSITIONS, cos, sin, heads, head_dim, groups)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)

    # The backward turns the incoming gradient by the opposite angle: rotating back gives the buffer it started as.
    leaf = qkv.clone().requires_grad_(True)
    rotated = packed_rope.rotate_query_key_(leaf * 1.0, POSITIONS, cos, sin, heads, head_dim, groups)
    rotated.backward(out.clone())
    torch.testing.assert_close(leaf.grad, qkv, rtol=1e-5, atol=1e-5)


def _rotate_then_split(qkv, cos, sin, heads, head_dim, groups):
    """What the split kernel replaces, in plain torch: rotate the grouped buffer, then the model's own split."""
    config = _config(num_attention_heads=heads, num_key_value_heads=groups, hidden_size=heads * head_dim)
    rotated = packed_rope.rotate_query_key_reference(qkv, POSITIONS, cos, sin, heads, head_dim, groups)
    return tuple(split_fused_qkv(rotated, config))


@pytest.mark.parametrize(("heads", "groups"), [(8, 2), (6, 3), (4, 4), (5, 1)], ids=["4-per-group", "2", "mha", "mqa"])
def test_rotate_split_gives_the_rotated_split_and_its_gradient(interpreted_kernel, heads, groups):
    """``rotate_split_qkv`` (the fused layers' GQA path): query, key and value as new contiguous tensors, equal to
    rotating the buffer and then splitting it, the buffer itself untouched; its backward writes the gradients of all
    three into the grouped layout as autograd through the plain-torch rotation and split does, also for strided
    gradients and for an output (the value here) that did not reach the loss."""
    head_dim = 16
    torch.manual_seed(0)
    config = _config(num_attention_heads=heads, num_key_value_heads=groups, hidden_size=heads * head_dim)
    cos, sin = rotary_halves(config_rotary_table(config, max(LENGTHS)))
    qkv = torch.randn(len(POSITIONS), (heads + 2 * groups) * head_dim)
    before = qkv.clone()
    split = packed_rope.rotate_split_qkv(qkv, POSITIONS, cos, sin, heads, head_dim, groups)
    assert torch.equal(qkv, before)
    expected = _rotate_then_split(qkv, cos, sin, heads, head_dim, groups)
    for actual, wanted, count in zip(split, expected, (heads, groups, groups)):
        assert actual.shape == (len(POSITIONS), count, head_dim) and actual.is_contiguous()
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)

    # Gradients: the query's arrives strided (a transposed copy seen through a transpose), the value's not at all.
    grad_query = torch.randn(heads, len(POSITIONS), head_dim).transpose(0, 1)
    grad_key = torch.randn(len(POSITIONS), groups, head_dim)
    kernel_leaf, reference_leaf = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    query, key, _ = packed_rope.rotate_split_qkv(kernel_leaf, POSITIONS, cos, sin, heads, head_dim, groups)
    torch.autograd.backward([query, key], [grad_query, grad_key])
    query, key, _ = _rotate_then_split(reference_leaf, cos, sin, heads, head_dim, groups)
    torch.autograd.backward([query, key], [grad_query, grad_key])
    torch.testing.assert_close(kernel_leaf.grad, reference_leaf.grad, rtol=1e-6, atol=1e-6)


def test_rotate_split_over_token_ranges_gives_each_range_its_own_tensors_and_the_same_gradient(interpreted_kernel):
    """``sizes`` (the fused layers' dense windows, then the packed rest): each range's query, key and value are tensors
    of their own (at the start of their buffer, so TE's attention takes them without a copy) holding the rows of the
    one-range split bit for bit, and the gradients of the ranges, handed back separately (one of them strided, one
    missing), make the grouped gradient the one-range split makes of the same gradients joined, bit for bit. Through
    ``_SelfAttention.split_qkv`` as the layer calls it; wrong ranges are refused."""
    from llama3_te.fused_residual_layer import _SelfAttention

    heads, groups, head_dim = 8, 2, 16
    torch.manual_seed(0)
    config = _config(num_attention_heads=heads, num_key_value_heads=groups, hidden_size=heads * head_dim)
    table = config_rotary_table(config, max(LENGTHS))
    cos, sin = rotary_halves(table)
    rotary = packed_rope.PackedQKVRotary(heads, head_dim, num_groups=groups)
    rotary.set_batch(POSITIONS, table)
    attention = type("Attention", (), {"num_heads": heads, "num_groups": groups, "head_dim": head_dim})()
    attention.qkv_rotary = rotary
    qkv = torch.randn(len(POSITIONS), (heads + 2 * groups) * head_dim)
    sizes = [7, 5]  # the first two sequences, then the third

    whole_leaf, ranges_leaf = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    (whole,) = _SelfAttention.split_qkv(attention, whole_leaf)
    parts = _SelfAttention.split_qkv(attention, ranges_leaf, sizes)
    assert len(parts) == 2
    for (start, end), part in zip([(0, 7), (7, 12)], parts):
        for tensor, full in zip(part, whole):
            assert tensor.is_contiguous() and tensor.storage_offset() == 0
            assert torch.equal(tensor, full[start:end])

    grads = [torch.randn_like(t) for t in whole]
    grads[2][7:] = 0  # the second range's value gradient is left out below: it counts as zeros
    torch.autograd.backward(list(whole), grads)
    second_query_grad = grads[0][7:].transpose(0, 1).contiguous().transpose(0, 1)  # strided rows
    torch.autograd.backward(
        [*parts[0], parts[1][0], parts[1][1]],
        [grads[0][:7], grads[1][:7], grads[2][:7], second_query_grad, grads[1][7:]],
    )
    assert torch.equal(ranges_leaf.grad, whole_leaf.grad)

    for wrong in ([7, 4], [13, -1]):
        with pytest.raises(ValueError, match="must be counts that add up to the 12 tokens"):
            packed_rope.rotate_split_qkv(qkv, POSITIONS, cos, sin, heads, head_dim, groups, wrong)


def test_gqa_fused_layers_take_the_split_path_and_others_keep_the_hook():
    """``PackedQKVRotary.attach`` hands a layer that splits the projection itself (an attention with a
    ``qkv_rotary`` slot) the rotary under GQA, and hooks the projection otherwise (TE's layers; no GQA)."""

    class Attention(torch.nn.Module):
        def __init__(self, with_slot: bool):
            super().__init__()
            self.layernorm_qkv = torch.nn.Linear(4, 4)
            if with_slot:
                self.qkv_rotary = None

    class Layer(torch.nn.Module):
        def __init__(self, with_slot: bool):
            super().__init__()
            self.self_attention = Attention(with_slot)

    def attached(num_groups, with_slot):
        layer = Layer(with_slot)
        rotary = packed_rope.PackedQKVRotary(8, 16, num_groups=num_groups)
        rotary.attach([layer])
        attention = layer.self_attention
        hooked = bool(attention.layernorm_qkv._forward_hooks)
        return getattr(attention, "qkv_rotary", None) is rotary, hooked

    assert attached(2, with_slot=True) == (True, False)
    assert attached(2, with_slot=False) == (False, True)
    assert attached(None, with_slot=True) == (False, True)
    assert attached(8, with_slot=True) == (False, True)
    # No batch set (cached decoding): the layer is told to split plainly.
    assert packed_rope.PackedQKVRotary(8, 16, num_groups=2).rotate_and_split(torch.zeros(3, 12 * 16)) is None


def config_rotary_table(config: NVLlamaConfig, length: int) -> torch.Tensor:
    """The model's own rotary table (Llama 3 frequency scaling included), [length, 1, 1, head_dim]."""
    return NVLlamaRotaryEmbedding(config)(length)


def rotary_halves(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = table.reshape(table.shape[0], -1)[:, : table.shape[-1] // 2]
    return torch.cos(angles).contiguous(), torch.sin(angles).contiguous()


def test_grouped_buffers_of_the_wrong_width_are_refused_with_the_layout(interpreted_kernel):
    cos, sin = rotary_halves(config_rotary_table(_config(), max(LENGTHS)))
    with pytest.raises(ValueError, match=r"\[tokens, 2 \* \(2 \+ 2\) \* 16\] QKV buffer, got \(12, 192\)"):
        packed_rope.rotate_query_key_(torch.zeros(12, 192), POSITIONS, cos, sin, 4, 16, 2)
    with pytest.raises(ValueError, match="4 query heads cannot be split into 3 key/value groups"):
        packed_rope.PackedQKVRotary(4, 16, num_groups=3)


def test_fused_layers_refuse_fp4_layers_in_the_config():
    with pytest.raises(ValueError, match="fused_residual_norm layers compute in bf16/fp32 or FP8"):
        _config(fused_residual_norm=True, layer_precision=["fp4", None])
    assert _config(fused_residual_norm=True, layer_precision=["fp8", None]).fused_residual_norm


def test_the_torch_backend_ignores_the_switch_so_an_export_loads_anywhere():
    """A checkpoint trained with the fused layers carries ``fused_residual_norm: true``; on a machine without TE it
    builds the torch layers, with the same keys, and runs."""
    model = NVLlamaForCausalLM(_config(fused_residual_norm=True))
    plain = NVLlamaForCausalLM(_config())
    assert model.model.qkv_rotary is None
    assert sorted(model.state_dict()) == sorted(plain.state_dict())
    model.load_state_dict(plain.state_dict())
    input_ids, attention_mask, labels = make_batch([9, 6])
    torch.testing.assert_close(
        model(input_ids, attention_mask=attention_mask, labels=labels).loss,
        plain(input_ids, attention_mask=attention_mask, labels=labels).loss,
    )


# ------------------------------------------------------------------------------------------------------ GPU


def _three_models():
    """One random stock Llama's weights as the torch layers, TE's layers and the fused layers, on the GPU."""
    torch.manual_seed(0)
    stock = randomize_(LlamaForCausalLM(hf_llama_config(LLAMA3_ROPE, **GPU_SHAPE)))
    return {
        "torch": convert_llama_hf_to_te(stock, backend="torch").cuda(),
        "te": convert_llama_hf_to_te(stock, backend="te").cuda(),
        "fused": convert_llama_hf_to_te(stock, backend="te", fused_residual_norm=True).cuda(),
    }


def _batch(input_format: str) -> dict:
    input_ids, attention_mask, labels = make_batch([200, 130, 77, 250, 31], seed=1)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if input_format == "thd":
        real = attention_mask.bool()
        lengths = attention_mask.sum(1)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        batch = {
            "input_ids": input_ids[real][None],
            "labels": labels[real][None],
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": int(lengths.max()),
            "max_length_k": int(lengths.max()),
        }
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.requires_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
@pytest.mark.parametrize("precision", ["bf16-autocast", "fp32"])
def test_fused_layers_compute_what_the_other_layers_compute(precision, input_format, recompute, monkeypatch):
    """Loss, logits and every gradient of the fused layers against the pure-PyTorch layers with the same weights,
    and against TE's layers.

    In float32 the fused layers do the torch layers' arithmetic (float32 GEMMs, norms and RoPE; attention by TE's
    unfused float32 path), so they agree to float32 accumulation-order noise. TE's own layers were ~1e-3 off both in
    float32 (on 1xH200; presumably TF32 in TE's float32 GEMMs, which torch's switch does not govern), which is why
    float32 is compared with the torch layers. In bf16 each is a few roundings per layer from the others: the model contract's TE-vs-torch
    tolerances (2e-2 on logits and loss, 5e-2 on gradients).
    """
    from llama3_te.fused_residual_layer import FusedResidualTransformerLayer

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means float32 here
    models = _three_models()
    assert all(isinstance(layer, FusedResidualTransformerLayer) for layer in models["fused"].model.layers)
    assert not any(isinstance(layer, FusedResidualTransformerLayer) for layer in models["te"].model.layers)
    assert sorted(models["fused"].state_dict()) == sorted(models["te"].state_dict())  # checkpoints load either way
    models["fused"].config.recompute_layers = GPU_SHAPE["num_hidden_layers"] if recompute else 0
    batch = _batch(input_format)
    autocast = precision == "bf16-autocast"
    real = batch["attention_mask"].bool() if input_format == "bshd" else slice(None)
    results = {}
    for name, model in models.items():
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            output = model(**batch)
        output.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[name] = (output.loss.detach(), output.logits[real].detach(), grads)

    def errors(name: str, reference: str) -> dict[str, float]:
        (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = results[name], results[reference]
        assert all(ref_grads[n] is not None and g is not None for n, g in grads.items())
        return {
            "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "logits": relative_error(logits, ref_logits),
            "grads": max(relative_error(g, ref_grads[n]) for n, g in grads.items()),
        }

    measured = {pair: errors(*pair) for pair in (("fused", "torch"), ("te", "torch"), ("fused", "te"))}
    print(precision, input_format, recompute, measured)  # the numbers, for the record (pytest -s)
    if autocast:
        limits = {"loss": 2e-2, "logits": 2e-2, "grads": 5e-2}
        checked = (("fused", "torch"), ("fused", "te"))
    else:
        limits = {"loss": 1e-5, "logits": 1e-4, "grads": 1e-3}
        checked = (("fused", "torch"),)
    for pair in checked:
        for quantity, limit in limits.items():
            assert measured[pair][quantity] < limit, (pair, quantity, measured)


@pytest.mark.requires_gpu
def test_rotate_split_matches_rotating_in_place_then_copying_bit_for_bit_on_the_gpu():
    """At Llama 3.2 1B's heads (32 queries in 8 groups, head_dim 64), bf16, 4,096 packed tokens: the compiled
    rotate-and-split kernel gives the path it replaced (in-place rotation, then the split's copies; backward: the
    concatenation, then the in-place inverse rotation) bit for bit, both ways."""
    heads, groups, head_dim = 32, 8, 64
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in (1500, 2, 2594)]).cuda()
    angles = positions.new_tensor(range(2600), dtype=torch.float32)[:, None] * torch.rand(head_dim // 2).cuda()
    cos, sin = torch.cos(angles).contiguous(), torch.sin(angles).contiguous()
    qkv = torch.randn(len(positions), (heads + 2 * groups) * head_dim, device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(len(positions), n, head_dim, device="cuda", dtype=torch.bfloat16) for n in (32, 8, 8)]

    new_leaf = qkv.clone().requires_grad_(True)
    new = packed_rope.rotate_split_qkv(new_leaf, positions, cos, sin, heads, head_dim, groups)
    torch.autograd.backward(new, grads)

    old_leaf = qkv.clone().requires_grad_(True)
    rotated = packed_rope.rotate_query_key_(old_leaf * 1, positions, cos, sin, heads, head_dim, groups)
    query, key, value = rotated.view(len(positions), groups, heads // groups + 2, head_dim).split([4, 1, 1], dim=2)
    old = (query.reshape(-1, heads, head_dim), key.reshape(-1, groups, head_dim), value.reshape(-1, groups, head_dim))
    torch.autograd.backward([t.contiguous() for t in old], grads)

    for a, b in zip(new, old):
        assert torch.equal(a, b)
    assert torch.equal(new_leaf.grad, old_leaf.grad)


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_fused_model_learns_the_same_bits_with_the_rotation_in_the_split_or_in_the_projection(monkeypatch):
    """The whole fused model, THD, bf16 autocast: loss and every gradient with the GQA rotation done while splitting
    (``rotate_and_split``, the default) equal those with the rotation in place in the projection followed by the
    copies (the hook path, which the layers used before) bit for bit. TE's attention backward is made deterministic
    for this (by default cuDNN may accumulate dQ in any order), and two runs of one path are checked equal first."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # read when TE's attention is built
    torch.manual_seed(0)
    stock = randomize_(LlamaForCausalLM(hf_llama_config(LLAMA3_ROPE, **GPU_SHAPE)))
    model = convert_llama_hf_to_te(stock, backend="te", fused_residual_norm=True).cuda().train()
    rotary = model.model.qkv_rotary
    assert all(layer.self_attention.qkv_rotary is rotary for layer in model.model.layers)
    batch = _batch("thd")

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def assert_same_bits(a, b):
        assert torch.equal(a[0], b[0])
        assert all(torch.equal(g, b[1][n]) for n, g in a[1].items())

    split = loss_and_grads()
    assert_same_bits(loss_and_grads(), split)
    for layer in model.model.layers:  # back to the in-place rotation: the projection's hook, then plain copies
        layer.self_attention.qkv_rotary = None
        layer.self_attention.layernorm_qkv.register_forward_hook(rotary._rotate_projection)
    assert_same_bits(loss_and_grads(), split)


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_fused_model_learns_the_same_bits_through_te_attention_and_the_direct_cudnn_calls(monkeypatch):
    """The fused layers' attention (``te_attention.PackedCuDNNAttention``) runs TE's ``DotProductAttention`` on its
    first call and TE's cuDNN kernels directly afterwards (grouped q/k/v as three tensors, causal): the whole model's
    loss and every gradient are equal bit for bit between the two (deterministic attention, as above)."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    calls = []
    apply = te_attention._CuDNNAttention.apply
    monkeypatch.setattr(te_attention._CuDNNAttention, "apply", lambda *args: calls.append(1) or apply(*args))
    torch.manual_seed(0)
    stock = randomize_(LlamaForCausalLM(hf_llama_config(LLAMA3_ROPE, **GPU_SHAPE)))
    model = convert_llama_hf_to_te(stock, backend="te", fused_residual_norm=True).cuda().train()
    batch = _batch("thd")

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    through_te = loss_and_grads()
    assert calls == []
    direct = loss_and_grads()
    assert len(calls) == GPU_SHAPE["num_hidden_layers"]
    assert all(torch.equal(a, b) for a, b in zip(direct, through_te))


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_fused_model_decodes_through_the_cache_as_its_full_forward():
    """Prefill and one-token steps through the KV cache (the cached path runs the fused layer's own sub-modules,
    with the rotation in the projection switched off) give the full forward's logits, and greedy generation picks
    TE's layers' tokens."""
    models = _three_models()
    plain, fused = models["te"].eval(), models["fused"].eval()
    input_ids, attention_mask, _ = make_batch([60, 41], seed=3, padding_side="left")
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    prefill = 40
    with torch.no_grad():
        full = fused(input_ids, attention_mask=attention_mask).logits.float()
        cache = DynamicCache(config=fused.config)
        steps = [fused(input_ids[:, :prefill], attention_mask=attention_mask[:, :prefill], past_key_values=cache)]
        for t in range(prefill, input_ids.shape[1]):
            steps.append(
                fused(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1], past_key_values=cache)
            )
        # A full forward after cached steps rotates in the projection again.
        again = fused(input_ids, attention_mask=attention_mask).logits.float()
    cached = torch.cat([step.logits.float() for step in steps], dim=1)
    real = attention_mask.bool()
    assert relative_error(cached[real], full[real]) < 1e-3
    torch.testing.assert_close(again, full)
    prompts = {"input_ids": input_ids[:, :prefill], "attention_mask": attention_mask[:, :prefill]}
    kwargs = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        assert torch.equal(fused.generate(**prompts, **kwargs), plain.generate(**prompts, **kwargs))


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_fused_layers_train_from_a_meta_device_init():
    config = NVLlamaConfig(**GPU_SHAPE, vocab_size=256, backend="te", fused_residual_norm=True)
    with torch.device("meta"):
        model = NVLlamaForCausalLM(config)
    model.init_empty_weights()
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attention.layernorm_qkv.layer_norm_weight, torch.ones(512, device="cuda"))
    assert layer.layernorm_mlp.fc1_weight.std().item() == pytest.approx(config.initializer_range, rel=0.1)
    model.train()
    batch = _batch("thd")
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


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_fp32_weights_under_autocast_get_gradients_finer_than_bf16():
    """fp32 master weights under bf16 autocast (DDP's default): the projections (the grouped QKV, proj, fc1, fc2) run
    TE's GEMMs, whose weight-gradient GEMMs write float32 gradients themselves, not bf16 ones cast up (what
    ``F.linear`` under autocast gives, and what these layers gave before). Every GEMM weight of every layer: >90% of
    its gradient values lie off the bf16 grid (bf16 values cast up: none)."""
    model = _three_models()["fused"].train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**_batch("thd")).loss.backward()
    checked = 0
    for name, param in model.model.layers.named_parameters():
        if param.dim() != 2:
            continue
        assert param.grad.dtype == torch.float32, name
        off_bf16_values = (param.grad != param.grad.bfloat16().float()).float().mean().item()
        assert off_bf16_values > 0.9, (name, off_bf16_values)
        checked += 1
    assert checked == 4 * GPU_SHAPE["num_hidden_layers"]  # QKV, proj, fc1, fc2
