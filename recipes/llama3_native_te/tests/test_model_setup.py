"""``build_model`` as the FSDP2 entrypoints call it, in one CPU process with bf16 compute over fp32 master weights.

The rotary-frequency table is fp32 by design (bf16 keeps 8 mantissa bits: the angle at position 8,000 would be off by
whole radians). FSDP2's default ``MixedPrecisionPolicy`` casts every floating-point argument of a sharded layer to
``param_dtype``, the table included; the recipe's policy must not. A forward pre-hook on the attention of a sharded
layer sees exactly what reaches it. The control case swaps in a policy that casts forward inputs and checks that the
same probe then sees bf16, so the probe can fail.
"""

import logging
from pathlib import Path

import model_setup
import pytest
import torch
import torch.distributed as dist
from distributed import DistributedConfig, build_meshes
from hydra import compose, initialize_config_dir
from model_setup import build_model
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor


CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_config"


@pytest.fixture
def one_process_group():
    """A gloo group of one process in an in-process store (what train_fsdp2.py makes for ``python train_fsdp2.py``)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def bf16_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(
            config_name="L0_sanity",
            overrides=["output_dir=unused", "mixed_precision.on_cpu=true", "mixed_precision.fp32_master_weights=true"]
            + list(overrides),
        )


def what_reaches_the_attention(built) -> dict[str, torch.dtype]:
    """dtypes of the hidden states and the rotary table that the first sharded layer's attention receives."""
    layer = built.model.model.layers[0]
    assert isinstance(layer, FSDPModule)
    seen = {}

    def record(module, args, kwargs):
        seen["hidden"] = args[0].dtype
        seen["rotary"] = kwargs["rotary_pos_emb"].dtype

    handle = layer.self_attention.register_forward_pre_hook(record, with_kwargs=True)
    input_ids = torch.tensor([[1, *b"ACGTTGCAACGTAAGG"]])
    try:
        loss = built.train_model(input_ids=input_ids, labels=input_ids).loss
    finally:
        handle.remove()
    assert torch.isfinite(loss)
    return seen


def test_fsdp2_keeps_the_rotary_table_fp32(one_process_group):
    device = torch.device("cpu")
    built = build_model(bf16_cfg(), device, build_meshes(DistributedConfig(), device), strategy="fsdp2")
    assert all(p.dtype == torch.float32 for p in built.model.parameters())  # fp32 master weights
    seen = what_reaches_the_attention(built)
    assert seen["hidden"] == torch.bfloat16  # the layer does compute in bf16 ...
    assert seen["rotary"] == torch.float32  # ... but the rotary angles arrive in fp32


def test_the_probe_sees_bf16_when_the_policy_casts_forward_inputs(one_process_group, monkeypatch):
    """Control: FSDP2's default (cast_forward_inputs=True) rounds the table to bf16, and the probe says so."""
    casting = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    monkeypatch.setattr(model_setup, "mixed_precision_policy", lambda mp_cfg, device: casting)
    device = torch.device("cpu")
    built = build_model(bf16_cfg(), device, build_meshes(DistributedConfig(), device), strategy="fsdp2")
    assert what_reaches_the_attention(built)["rotary"] == torch.bfloat16


def test_bf16_weights_without_fp32_master_weights(one_process_group):
    device = torch.device("cpu")
    cfg = bf16_cfg("mixed_precision.fp32_master_weights=false")
    built = build_model(cfg, device, build_meshes(DistributedConfig(), device), strategy="fsdp2")
    assert all(p.dtype == torch.bfloat16 for p in built.model.parameters())
    assert what_reaches_the_attention(built)["rotary"] == torch.float32


def test_unknown_strategy_fails():
    with pytest.raises(ValueError, match="strategy must be one of"):
        build_model(bf16_cfg(), torch.device("cpu"), None, strategy="zero3")


@pytest.mark.parametrize("keep", [False, True], ids=["default", "reshard_after_backward=false"])
def test_weights_stay_gathered_between_micro_batches_only_when_asked(one_process_group, keep):
    """``fsdp.reshard_after_backward=false``: a micro-batch that does not sync gradients leaves the layers holding
    their gathered weights (plain parameters), so the next micro-batch gathers nothing; the step's last micro-batch
    frees them (sharded DTensors again, as the optimizer needs). By default every backward frees them."""
    device = torch.device("cpu")
    cfg = bf16_cfg(f"fsdp.reshard_after_backward={str(not keep).lower()}")
    built = build_model(cfg, device, build_meshes(DistributedConfig(), device), strategy="fsdp2")
    layer = built.model.model.layers[0]
    input_ids = torch.tensor([[1, *b"ACGTTGCAACGTAAGG"]])
    sharded_after = []
    for last in (False, True):
        with built.gradient_sync(last):
            built.train_model(input_ids=input_ids, labels=input_ids).loss.backward()
        sharded_after.append(all(isinstance(p, DTensor) for p in layer.parameters()))
    assert sharded_after == [not keep, True]


def _plan_as_on_a_gpu(monkeypatch):
    """The per-layer plan as on a GPU machine; TE's recipe object (not needed here) stands in as None."""

    def plan(fp8, fp4, layers):
        precision = "fp4" if fp4["enabled"] else "fp8" if fp8["enabled"] else None
        return model_setup.QuantizationPlan([precision] * layers if precision else None)

    monkeypatch.setattr(model_setup, "build_quantization", plan)


@pytest.mark.parametrize("fp8_recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_runs_keep_the_fused_layers(monkeypatch, caplog, fp8_recipe):
    """The fused layers run FP8 with these recipes (TE's FP8 GEMMs behind the fused norms): no fallback."""
    _plan_as_on_a_gpu(monkeypatch)
    fused = "+model_config_overrides.fused_residual_norm=true"
    with caplog.at_level(logging.WARNING):
        config, _ = model_setup.load_model_config(
            bf16_cfg(fused, "fp8_config.enabled=true", f"fp8_config.fp8_recipe={fp8_recipe}")
        )
    assert config.fused_residual_norm and config.layer_precision == ["fp8"] * config.num_hidden_layers
    assert "fused_residual_norm is off" not in caplog.text


@pytest.mark.parametrize(
    ("run_overrides", "reason"),
    [
        (["fp4_config.enabled=true"], "this run has FP4 layers"),
        (["fp8_config.enabled=true", "fp8_config.fp8_recipe=MXFP8BlockScaling"], "not MXFP8BlockScaling"),
        (["cp_size=2"], "context-parallel group"),
        (["use_torch_compile=true"], "torch.compile"),
    ],
    ids=["fp4", "mxfp8", "context-parallel", "torch-compile"],
)
def test_fused_layers_are_switched_off_where_they_cannot_run(monkeypatch, caplog, run_overrides, reason):
    """A run that asks for fused_residual_norm (as the 1B configs do) and adds FP4 layers, FP8 with MXFP8 (not run by
    the fused layers), context parallelism or torch.compile gets TE's layers and one warning that says why, not the
    model's refusal."""
    _plan_as_on_a_gpu(monkeypatch)
    fused = "+model_config_overrides.fused_residual_norm=true"
    as_is, _ = model_setup.load_model_config(bf16_cfg(fused))
    assert as_is.fused_residual_norm  # kept by a run that can use it
    with caplog.at_level(logging.WARNING):
        config, _ = model_setup.load_model_config(bf16_cfg(fused, *run_overrides))
    assert not config.fused_residual_norm
    assert "fused_residual_norm is off for this run (TE's layers instead)" in caplog.text and reason in caplog.text
