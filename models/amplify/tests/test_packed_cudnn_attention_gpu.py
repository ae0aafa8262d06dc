"""te_attention.PackedCuDNNAttention: its first call with a signature runs TE's ``DotProductAttention``, later
calls run TE's cuDNN kernels directly where TE chose them, with the same bits as TE's own path (in 16 bits and under
FP8 autocast, where attention stays in 16 bits); every call that needs TE's path (fp32, FP8 attention, another
backend, other arguments) keeps taking it.

cuDNN's attention backward may add dQ in any order unless TE asks for its deterministic algorithm, so every module
here is built with ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (read when TE's attention is built) and compared bit for
bit."""

import pytest
import torch
import torch.nn.functional as F
from amplify_testing import make_batch, reference_model, reference_to_nv
from model_contract import pack

from amplify_te import te_attention


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]

LENGTHS = [200, 130, 77, 250, 31]
# (layout, heads, key/value heads, mask): AMPLIFY's and ESM-2's views of one QKV buffer (15 heads of 64, as AMPLIFY
# 350M), and Llama's grouped-query attention with separate contiguous tensors and a causal mask.
CASES = {"th3d": (15, 15, "padding"), "thd_thd_thd": (8, 2, "padding_causal")}


@pytest.fixture
def direct_calls(monkeypatch):
    """How many times the direct cuDNN path ran."""
    calls = []
    apply = te_attention._CuDNNAttention.apply
    monkeypatch.setattr(te_attention._CuDNNAttention, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls


def _attention(cls, heads, groups, mask):
    module = cls(heads, 64, num_gqa_groups=groups, attention_dropout=0.0, qkv_format="thd", attn_mask_type=mask)
    assert module.deterministic
    return module


def _inputs(layout, heads, groups, dtype, tail=0):
    """Leaves (the QKV buffer, or query, key and value) and a function that makes query, key, value from them;
    ``tail``: rows after the last sequence (alignment padding)."""
    torch.manual_seed(0)
    tokens = sum(LENGTHS) + tail
    if layout == "th3d":
        leaves = [torch.randn(tokens, heads, 3, 64, device="cuda", dtype=dtype, requires_grad=True)]
        return leaves, lambda: te_attention.SplitPackedQKV.apply(leaves[0], -2)
    shapes = [(tokens, heads, 64), (tokens, groups, 64), (tokens, groups, 64)]
    leaves = [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for shape in shapes]
    return leaves, lambda: leaves


def _run(module, leaves, make_qkv, mask, **extra):
    """Attention's output and the leaves' gradients for a fixed output gradient."""
    for leaf in leaves:
        leaf.grad = None
    cu_seqlens = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32).cuda()
    query, key, value = make_qkv()
    out = module(
        query,
        key,
        value,
        qkv_format="thd",
        attn_mask_type=mask,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(LENGTHS),
        max_seqlen_kv=max(LENGTHS),
        **extra,
    )
    grad = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(1), device="cuda", dtype=out.dtype)
    out.backward(grad)
    return [out.detach()] + [leaf.grad.clone() for leaf in leaves]


def _te_gradients(layout, heads, groups, tail):
    """TE's own attention (the reference): output and leaf gradients, and the leaves and q/k/v maker."""
    leaves, make_qkv = _inputs(layout, heads, groups, torch.bfloat16, tail)
    mask = CASES[layout][2]
    return _run(_attention(te_attention.te.DotProductAttention, heads, groups, mask), leaves, make_qkv, mask), leaves


def _assert_same_bits(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", list(CASES))
def test_direct_calls_give_te_attention_bits(layout, dtype, direct_calls, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    heads, groups, mask = CASES[layout]
    leaves, make_qkv = _inputs(layout, heads, groups, dtype)
    reference = _run(_attention(te_attention.te.DotProductAttention, heads, groups, mask), leaves, make_qkv, mask)
    module = _attention(te_attention.PackedCuDNNAttention, heads, groups, mask)
    first = _run(module, leaves, make_qkv, mask)
    assert direct_calls == []  # the first call with a signature is TE's
    assert list(module._cudnn_chosen.values()) == [True]
    second = _run(module, leaves, make_qkv, mask)
    assert direct_calls == [1]
    _assert_same_bits(first, reference)
    _assert_same_bits(second, reference)
    if layout == "th3d":  # dQ, dK and dV side by side in one buffer, as TE's path gives them (no stacking copy)
        query, key, value = make_qkv()
        cu_seqlens = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32).cuda()
        out = module(query, key, value, qkv_format="thd", cu_seqlens_q=cu_seqlens, max_seqlen_q=max(LENGTHS))
        seen = []
        query.register_hook(seen.append)
        out.sum().backward()
        assert seen[0].stride() == leaves[0].stride()[:2] + leaves[0].stride()[3:]


def test_calls_that_need_te_path_keep_taking_it(direct_calls, monkeypatch):
    """fp32 (cuDNN has no fp32 attention: TE runs its unfused path), an argument that asks for more than the packed
    call does (attention recomputed in the backward), and a signature for which TE chose another backend (here: said
    to have)."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    heads, groups, mask = CASES["th3d"]
    module = _attention(te_attention.PackedCuDNNAttention, heads, groups, mask)
    fp32_leaves, fp32_qkv = _inputs("th3d", heads, groups, torch.float32)
    expected = _run(_attention(te_attention.te.DotProductAttention, heads, groups, mask), fp32_leaves, fp32_qkv, mask)
    for _ in range(2):
        _assert_same_bits(_run(module, fp32_leaves, fp32_qkv, mask), expected)
    leaves, make_qkv = _inputs("th3d", heads, groups, torch.bfloat16)
    for _ in range(2):
        _run(module, leaves, make_qkv, mask, checkpoint_core_attention=True)
    assert direct_calls == [] and module._cudnn_chosen == {}

    monkeypatch.setattr(te_attention, "_te_chose_cudnn", lambda: False)
    other = _attention(te_attention.PackedCuDNNAttention, heads, groups, mask)
    for _ in range(2):
        _run(other, leaves, make_qkv, mask)
    assert direct_calls == [] and list(other._cudnn_chosen.values()) == [False]


def test_taken_over_attention_hands_te_path_its_inputs_untouched(monkeypatch):
    """TE's layers' attention after ``call_cudnn_directly``: a call the direct path does not take reaches
    ``te.DotProductAttention.forward`` with the very tensors TE's MultiheadAttention gave it (after TE's RoPE: rotated
    query and key, value a view into the projection), where the fused layers' attention copies views that do not
    start their buffer (``_at_buffer_start``)."""
    heads, groups, mask = CASES["th3d"]
    seen = []
    monkeypatch.setattr(
        te_attention.te.DotProductAttention, "forward", lambda self, *args, **kwargs: seen.append(args)
    )
    packed = torch.randn(sum(LENGTHS), heads, 3, 64, device="cuda", dtype=torch.bfloat16)
    query, key, value = packed[:, :, 0].clone(), packed[:, :, 1].clone(), packed[:, :, 2]
    cu_seqlens = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32).cuda()
    taken_over = te_attention.te.DotProductAttention(heads, 64, attention_dropout=0.0, qkv_format="thd")
    te_attention.PackedCuDNNAttention.take_over(taken_over)
    fused_layers_own = te_attention.PackedCuDNNAttention(heads, 64, attention_dropout=0.0, qkv_format="thd")
    for module in (taken_over, fused_layers_own):
        module(query, key, value, qkv_format="thd", cu_seqlens_q=cu_seqlens, max_seqlen_q=max(LENGTHS))
    assert all(a is b for a, b in zip(seen[0][:3], (query, key, value)))
    assert seen[1][0] is not query and torch.equal(seen[1][2], value)  # copied, same values


@pytest.mark.requires_fp8
def test_under_fp8_autocast_attention_in_16_bits_goes_direct(direct_calls, monkeypatch):
    """FP8 autocast with a recipe that leaves attention in 16 bits (the default: no ``fp8_dpa``): the first call under
    it is TE's (a signature of its own, also after the same call outside FP8), later ones direct, with TE's bits."""
    from transformer_engine.common.recipe import DelayedScaling

    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    heads, groups, mask = CASES["th3d"]
    leaves, make_qkv = _inputs("th3d", heads, groups, torch.bfloat16)
    reference = _attention(te_attention.te.DotProductAttention, heads, groups, mask)
    with te_attention.te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        expected = _run(reference, leaves, make_qkv, mask)
    module = _attention(te_attention.PackedCuDNNAttention, heads, groups, mask)
    _run(module, leaves, make_qkv, mask)
    assert direct_calls == []
    results = []
    for _ in range(2):
        with te_attention.te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            results.append(_run(module, leaves, make_qkv, mask))
    assert direct_calls == [1]
    assert sorted(module._cudnn_chosen.values()) == [True, True]  # one signature outside FP8, one under it
    for result in results:
        _assert_same_bits(result, expected)


@pytest.mark.requires_fp8
def test_a_recipe_with_fp8_attention_takes_te_path(monkeypatch):
    """``fp8_dpa``/``fp8_mha`` put attention itself in FP8, which is TE's business (decided before any kernel runs: on
    packed input TE 2.20 needs a newer cuDNN for it than the GPU machine has)."""
    from transformer_engine.common.recipe import DelayedScaling

    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    heads, groups, mask = CASES["th3d"]
    module = _attention(te_attention.PackedCuDNNAttention, heads, groups, mask)
    leaves, make_qkv = _inputs("th3d", heads, groups, torch.bfloat16)
    query, key, value = make_qkv()
    arguments = {"attention_mask": None, "qkv_format": "thd", "cu_seqlens_q": torch.zeros(2, dtype=torch.int32),
                 "max_seqlen_q": 8}  # fmt: skip
    for recipe, direct in [(DelayedScaling(), True), (DelayedScaling(fp8_dpa=True), False),
                           (DelayedScaling(fp8_mha=True), False)]:  # fmt: skip
        with te_attention.te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            signature = module._signature(query, key, value, mask, arguments, (), {})
        assert (signature is not None) == direct, recipe


def test_fused_amplify_learns_the_same_bits_from_its_second_step_on(direct_calls, monkeypatch):
    """The fused-layer AMPLIFY model (THD, bf16 autocast): the first step runs TE's attention, the second the direct
    calls; loss and every gradient are equal bit for bit."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    shape = {"num_hidden_layers": 2, "hidden_size": 960, "num_attention_heads": 15, "intermediate_size": 1920}
    model = reference_to_nv(reference_model(shape), backend="te", fused_residual_norm=True).cuda().train()
    assert all(isinstance(layer.self_attention.core_attention, te_attention.PackedCuDNNAttention)
               for layer in model.amplify.layers)  # fmt: skip
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in pack(make_batch(LENGTHS)).items()}

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    first = loss_and_grads()
    assert direct_calls == []
    second = loss_and_grads()
    assert len(direct_calls) == shape["num_hidden_layers"]
    _assert_same_bits(second, first)


@pytest.mark.parametrize("layout", list(CASES))
def test_the_backward_without_te_fill_gives_te_bits_and_zero_rows_after_the_sequences(layout, monkeypatch):
    """The direct path's backward (te_attention_backward.py: TE's C entry point on unfilled buffers): dQ, dK and dV
    bit for bit as TE's path gives them, with 13 rows of alignment padding after the last sequence; and called
    directly on buffers full of NaN, the rows after the last sequence come out zero and the others as TE's."""
    from amplify_te import te_attention_backward

    assert te_attention_backward.available()
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    heads, groups, mask = CASES[layout]
    tail = 13
    expected, _ = _te_gradients(layout, heads, groups, tail)
    calls = []
    backward = te_attention.backward_without_fill
    monkeypatch.setattr(te_attention, "backward_without_fill", lambda *a, **k: calls.append(1) or backward(*a, **k))
    leaves, make_qkv = _inputs(layout, heads, groups, torch.bfloat16, tail)
    module = _attention(te_attention.PackedCuDNNAttention, heads, groups, mask)
    _run(module, leaves, make_qkv, mask)  # TE's path: its choice of backend is recorded
    _assert_same_bits(_run(module, leaves, make_qkv, mask), expected)
    assert calls == [1]
    for gradient in expected[1:]:
        assert not gradient[-tail:].any()  # what TE's fill gave the padding rows

    # Directly, on poisoned buffers: nothing but cuDNN's writes and the tail kernel may reach the result.
    query, key, value = (t.detach() for t in make_qkv())
    cu_seqlens = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32).cuda()
    settings = {"training": True, "max_seqlen_q": max(LENGTHS), "max_seqlen_kv": max(LENGTHS), "scale": 0.125,
                "layout": layout, "mask_type": mask, "window": (-1, 0) if "causal" in mask else (-1, -1),
                "deterministic": True}  # fmt: skip
    out, aux = te_attention.fused_attn_fwd(
        is_training=True, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS), cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens, q=query, k=key, v=value, fake_dtype=query.dtype,
        fused_attention_backend=te_attention.FusedAttnBackend["F16_arbitrary_seqlen"], cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens, attn_scale=0.125, qkv_layout=layout, o_format="thd", attn_mask_type=mask,
        window_size=settings["window"],
    )[:2]  # fmt: skip
    grad_out = torch.randn_like(out)
    te_grads = te_attention.fused_attn_bwd(
        max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS), cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        q=query, k=key, v=value, o=out, d_o=grad_out, fake_dtype=query.dtype, aux_ctx_tensors=aux,
        fused_attention_backend=te_attention.FusedAttnBackend["F16_arbitrary_seqlen"], cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens, attn_scale=0.125, qkv_layout=layout, o_format="thd", do_format="thd",
        dqkv_layout=layout, attn_mask_type=mask, window_size=settings["window"], deterministic=True,
    )[:3]  # fmt: skip
    buffers, gradients = te_attention_backward.empty_gradients(query, key, value, layout)
    for buffer in buffers:
        buffer.fill_(float("nan"))
    ours = te_attention_backward.backward_without_fill(
        query, key, value, out, grad_out, aux, cu_seqlens, cu_seqlens, settings, buffers=(buffers, gradients)
    )
    for mine, theirs in zip(ours, te_grads):
        assert torch.equal(mine, theirs)
        assert not mine[-tail:].any() and mine[:-tail].abs().sum() > 0
