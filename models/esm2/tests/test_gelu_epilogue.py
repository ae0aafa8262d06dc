"""The TE backend computes fc1's bias + GELU in the GEMM epilogues (``use_gemm_epilogue_gelu``), a speed-up over TE's
default compiled elementwise kernels. Same math (tanh GELU), fused differently: training must give the same losses
and weights within bf16 rounding."""

import os

import pytest
import torch
from esm_testing import hf_esm2_config, make_batch, randomize_
from transformers import EsmForMaskedLM

from esm2_te.convert import convert_esm_hf_to_te


SHAPE = {"num_hidden_layers": 3, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024}


def _trained(epilogue: bool, steps: int = 6) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(0)
    hf_model = randomize_(EsmForMaskedLM(hf_esm2_config(**SHAPE)))
    model = convert_esm_hf_to_te(hf_model, backend="te").cuda().train()
    layers = model.esm.encoder.layers
    assert all(layer.layernorm_mlp.bias_gelu_nvfusion is False for layer in layers), "the epilogue is the default"
    if not epilogue:
        for layer in layers:
            layer.layernorm_mlp.bias_gelu_nvfusion = True  # TE's default path: compiled bias + GELU kernels
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids, attention_mask, labels = make_batch([200, 130, 77, 250, 31])  # one batch, learnt over the steps
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids.cuda(), attention_mask=attention_mask.cuda(), labels=labels.cuda()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.requires_gpu
@pytest.mark.requires_te
@pytest.mark.skipif("NVTE_BIAS_GELU_NVFUSION" in os.environ, reason="the environment picks TE's fusion path")
def test_gelu_in_gemm_epilogue_trains_like_the_compiled_kernels():
    epilogue_losses, epilogue_model = _trained(epilogue=True)
    compiled_losses, compiled_model = _trained(epilogue=False)
    assert epilogue_losses == pytest.approx(compiled_losses, rel=1e-2)
    assert epilogue_losses[-1] < epilogue_losses[0]  # it learns
    compiled_params = dict(compiled_model.named_parameters())
    for name, param in epilogue_model.named_parameters():
        error = (param - compiled_params[name]).norm() / compiled_params[name].norm()
        assert error < 2e-2, (name, error.item())
