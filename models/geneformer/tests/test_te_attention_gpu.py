"""Geneformer's TE layers take attention's query, key and value as views of the QKV projection (te_attention.py, a
speed-up: no zero-filled gradient copies). On the GPU that must train exactly like TE's own packed-QKV path. The
split itself is tested on CPU in tests/test_te_attention.py."""

import pytest
import torch
from geneformer_testing import make_batch, shape_of, stock_model

from geneformer_te.convert import convert_geneformer_hf_to_te


def _without_split_hooks(model: torch.nn.Module) -> int:
    removed = 0
    for module in model.modules():
        if type(module).__name__ == "DotProductAttention" and module._forward_pre_hooks:
            module._forward_pre_hooks.clear()
            removed += 1
    return removed


@pytest.mark.requires_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_attention_inputs_split_by_the_model_train_exactly_like_te_packed_inputs(input_format):
    model = convert_geneformer_hf_to_te(stock_model(**shape_of("geneformer_10M")), backend="te").cuda().train()
    batch = make_batch([200, 130, 77, 250, 31])
    if input_format == "thd":
        keep = batch["attention_mask"].bool()
        lengths = batch["attention_mask"].sum(1)
        batch = {
            "input_ids": batch["input_ids"][keep][None],
            "labels": batch["labels"][keep][None],
            "cu_seq_lens_q": torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int(),
            "max_length_q": int(lengths.max()),
        }
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    results = []
    for hooked in (True, False):
        if not hooked:
            assert _without_split_hooks(model) == model.config.num_hidden_layers  # every layer had the hook
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (split_loss, split_grads), (packed_loss, packed_grads) = results
    assert split_loss == pytest.approx(packed_loss, rel=1e-6)
    assert split_grads.keys() == packed_grads.keys()
    for name, grad in split_grads.items():
        error = (grad - packed_grads[name]).float().norm() / packed_grads[name].float().norm().clamp(min=1e-12)
        assert error < 1e-3, (name, error.item())
