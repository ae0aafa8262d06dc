"""AMPLIFY with rotary embeddings applied inside the QKV projection (packed_rope.py, ``fused_qkv_rope=True``) gives
the numbers of TE's own RoPE path. The kernel itself is tested on CPU in models/esm2/tests/test_packed_rope.py."""

import pytest
import torch
from amplify_testing import make_batch, reference_model, reference_to_nv
from model_contract import pack


@pytest.mark.requires_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_amplify_with_rope_in_the_projection_equals_te_rope(input_format, recompute):
    """Also with every layer of the kernel's model recomputed in backward (the rotation's batch must still hold)."""
    # 15 heads of 64, as AMPLIFY 350M: a head count that is not a power of two.
    shape = {"num_hidden_layers": 2, "hidden_size": 960, "num_attention_heads": 15, "intermediate_size": 1920}
    reference = reference_model(shape)
    models = {
        flag: reference_to_nv(reference, backend="te", fused_qkv_rope=flag).cuda().train() for flag in (True, False)
    }
    assert models[True].amplify.qkv_rotary is not None and models[False].config.fused_qkv_rope is False
    layers = models[True].amplify.layers
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
    models[True].config.recompute_layers = len(layers) if recompute else 0
    batch = make_batch([200, 130, 77, 250, 31])
    if input_format == "thd":
        batch = pack(batch)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    outputs = {}
    for flag, model in models.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs[flag] = model(**batch)
        outputs[flag].loss.backward()
    assert outputs[True].loss.item() == pytest.approx(outputs[False].loss.item(), rel=2e-3)
    logits_error = (outputs[True].logits - outputs[False].logits).float().norm() / outputs[False].logits.float().norm()
    assert logits_error < 1e-2
    reference_params = dict(models[False].named_parameters())
    for name, param in models[True].named_parameters():
        expected = reference_params[name].grad
        if param.grad is None:
            assert expected is None, name
            continue
        error = (param.grad - expected).float().norm() / expected.float().norm().clamp(min=1e-12)
        assert error < 2e-2, (name, error.item())
    assert calls == [2 if recompute else 1] * len(layers)  # a recomputed layer runs again in backward
