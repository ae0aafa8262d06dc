"""What ``model_setup.build_model`` hands train_fsdp2.py, train_cp.py and train_ddp.py, checked in one CPU process.

og2 trains 8,192-token windows (and longer ones under context parallelism), where RoPE angles need fp32: with bf16's
8 mantissa bits the angle at position 8,000 is off by whole radians. The recipe computes in bf16 over fp32 master
weights, and FSDP2 by default casts every floating-point input of a sharded layer to bf16, the rotary table among
them. A pre-hook on the first sharded layer's attention records what actually arrives there (bf16 on CPU through
``mixed_precision.on_cpu``); a control run with a casting policy shows that the same hook reports bf16 when it
should. Also: bf16 weights without fp32 masters, fp32 on CPU by default, the ``ddp`` strategy's weights, and no
other strategy.
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
    """L0_sanity (the og2 stability switches on, torch backend on CPU) with bf16 compute on CPU."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(
            config_name="L0_sanity",
            overrides=["output_dir=unused", "mixed_precision.on_cpu=true", *overrides],
        )


def build_on_cpu(cfg):
    device = torch.device("cpu")
    return build_model(cfg, device, build_meshes(DistributedConfig(), device), strategy="fsdp2")


def run_and_probe(built) -> dict:
    """dtypes of the hidden states, the rotary table and the weights that the first sharded layer's attention
    computes with, after one forward and backward through the model the loop calls."""
    layer = built.model.model.layers[0]
    assert isinstance(layer, FSDPModule)
    seen = {}

    def record(module, args, kwargs):
        seen["hidden"] = args[0].dtype
        seen["rotary"] = kwargs["rotary_pos_emb"].dtype
        seen["compute_weight"] = module.proj.weight.dtype

    handle = layer.self_attention.register_forward_pre_hook(record, with_kwargs=True)
    # Two packed sequences (THD, the recipe's default layout).
    input_ids = torch.tensor([[1, *b"ACGTTGCAACGTAAGG", 1, *b"TTGACA"]])
    cu_seq_lens = torch.tensor([0, 17, 24], dtype=torch.int32)
    try:
        loss = built.train_model(input_ids=input_ids, labels=input_ids, cu_seq_lens_q=cu_seq_lens).loss
    finally:
        handle.remove()
    assert torch.isfinite(loss)
    loss.backward()
    seen["gradients"] = {p.grad.dtype for p in built.model.parameters()}
    return seen


def test_fsdp2_keeps_the_rotary_table_fp32(one_process_group):
    built = build_on_cpu(bf16_cfg())
    assert {p.dtype for p in built.model.parameters()} == {torch.float32}  # fp32 master weights
    seen = run_and_probe(built)
    assert seen["hidden"] == torch.bfloat16 and seen["compute_weight"] == torch.bfloat16  # bf16 compute ...
    assert seen["gradients"] == {torch.float32}  # ... fp32 gradients on the masters ...
    assert seen["rotary"] == torch.float32  # ... and the rotary angles arrive in fp32


def test_the_probe_sees_bf16_when_the_policy_casts_forward_inputs(one_process_group, monkeypatch):
    """Control: FSDP2's default (cast_forward_inputs=True) rounds the table to bf16, and the probe says so."""
    casting = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    monkeypatch.setattr(model_setup, "mixed_precision_policy", lambda mp_cfg, device: casting)
    assert run_and_probe(build_on_cpu(bf16_cfg()))["rotary"] == torch.bfloat16


def test_bf16_weights_without_fp32_master_weights(one_process_group):
    built = build_on_cpu(bf16_cfg("mixed_precision.fp32_master_weights=false"))
    assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    assert run_and_probe(built)["rotary"] == torch.float32


def test_fp32_on_cpu_unless_asked(one_process_group):
    """L0_sanity as shipped: bf16 compute is for CUDA; on CPU it is opt-in (``mixed_precision.on_cpu``)."""
    built = build_on_cpu(bf16_cfg("mixed_precision.on_cpu=false"))
    seen = run_and_probe(built)
    assert (seen["hidden"], seen["compute_weight"], seen["rotary"]) == (torch.float32,) * 3


def test_unknown_strategy_fails():
    with pytest.raises(ValueError, match="strategy must be one of"):
        build_model(bf16_cfg(), torch.device("cpu"), None, strategy="mfsdp")


def test_ddp_builds_the_weights_fsdp2_builds_without_the_meta_device(one_process_group):
    """``"ddp"`` in one process: the model itself (no wrapper, nothing to average), plain tensors on the device, and
    the weights FSDP2 builds from the same seed when it constructs on the device too (train_ddp.py and
    train_fsdp2.py fsdp.use_meta_device=false start alike); fp32 master weights, as on CPU by default."""
    cfg = bf16_cfg("mixed_precision.on_cpu=false", "fsdp.use_meta_device=false")
    ddp = build_model(cfg, torch.device("cpu"), None, strategy="ddp")
    assert ddp.ddp is None and ddp.train_model is ddp.model and ddp.strategy == "ddp"
    assert not any(isinstance(p, DTensor) for p in ddp.model.parameters())
    assert {p.dtype for p in ddp.model.parameters()} == {torch.float32}
    sharded = build_on_cpu(cfg).model.state_dict()
    for name, value in ddp.model.state_dict().items():
        expected = sharded[name].full_tensor() if isinstance(sharded[name], DTensor) else sharded[name]
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("keep", [False, True], ids=["default", "reshard_after_backward=false"])
def test_weights_stay_gathered_between_micro_batches_only_when_asked(one_process_group, keep):
    """``fsdp.reshard_after_backward=false``: a micro-batch that does not sync gradients leaves the layers holding
    their gathered weights (plain parameters), so the next micro-batch gathers nothing; the step's last micro-batch
    frees them (sharded DTensors again, as the optimizer needs). By default every backward frees them."""
    built = build_on_cpu(bf16_cfg(f"fsdp.reshard_after_backward={str(not keep).lower()}"))
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
