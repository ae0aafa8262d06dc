"""``build_model`` as the entrypoints call it, in one CPU process with bf16 compute over fp32 master weights.

The rotary-frequency table is fp32 by design (bf16 keeps 8 mantissa bits: the angle at position 1,000 would be off
by several radians). FSDP2's default ``MixedPrecisionPolicy`` casts every floating-point argument of a sharded layer
to ``param_dtype``, the table included; the recipe's policy must not. A forward pre-hook on the attention of a
sharded layer sees exactly what reaches it. The control case swaps in a policy that casts forward inputs and checks
that the same probe then sees bf16, so the probe can fail.
"""

import logging
import warnings
from pathlib import Path

import distributed
import model_families
import model_setup
import pytest
import torch
import torch.distributed as dist
from compensated_adamw import CompensatedAdamW
from distributed import DistributedConfig, build_meshes, data_parallel_wrapper, wrap_in_ddp
from hydra import compose, initialize_config_dir
from model_families import load_model_config
from model_setup import build_model, build_optimizer
from omegaconf import OmegaConf
from quantization import QuantizationPlan, resolve_layer_precision
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel


CPU = torch.device("cpu")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_config"
TINY = (
    "+model_config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4}"
)


@pytest.fixture
def one_process_group():
    """A gloo group of one process in an in-process store (what train_fsdp2.py makes for ``python train_fsdp2.py``)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def bf16_cfg(*overrides: str, backend: str = "torch"):
    """L0_sanity's tiny shape, bf16 compute on any device; the torch backend unless asked (so a GPU machine runs the
    CPU tests as a CPU machine does)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(
            config_name="L0_sanity",
            overrides=["output_dir=unused", "mixed_precision.on_cpu=true", "mixed_precision.fp32_master_weights=true"]
            + [TINY, f"+model_config_overrides.backend={backend}", *overrides],
        )


def what_reaches_the_attention(built, device: torch.device = CPU) -> dict[str, torch.dtype]:
    """dtypes of the hidden states and the rotary table that the first sharded layer's attention receives."""
    layer = built.model.esm.encoder.layers[0]
    assert isinstance(layer, FSDPModule)
    seen = {}

    def record(module, args, kwargs):
        seen["hidden"] = args[0].dtype
        seen["rotary"] = kwargs["rotary_pos_emb"].dtype

    handle = layer.self_attention.register_forward_pre_hook(record, with_kwargs=True)
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 32, 12, 13, 2]], device=device)
    labels = torch.full_like(input_ids, -100)
    labels[0, 8] = 14
    try:
        loss = built.train_model(input_ids=input_ids, labels=labels).loss
    finally:
        handle.remove()
    assert torch.isfinite(loss)
    return seen


def build_fsdp2(cfg, device: torch.device = CPU):
    return build_model(cfg, device, build_meshes(DistributedConfig(), device), strategy="fsdp2")


def test_fsdp2_keeps_the_rotary_table_fp32(one_process_group):
    built = build_fsdp2(bf16_cfg())
    assert all(p.dtype == torch.float32 for p in built.model.parameters())  # fp32 master weights
    seen = what_reaches_the_attention(built)
    assert seen["hidden"] == torch.bfloat16  # the layer does compute in bf16 ...
    assert seen["rotary"] == torch.float32  # ... but the rotary angles arrive in fp32


def test_the_probe_sees_bf16_when_the_policy_casts_forward_inputs(one_process_group, monkeypatch):
    """Control: FSDP2's default (cast_forward_inputs=True) rounds the table to bf16, and the probe says so."""
    casting = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    monkeypatch.setattr(model_setup, "mixed_precision_policy", lambda mp_cfg, device: casting)
    assert what_reaches_the_attention(build_fsdp2(bf16_cfg()))["rotary"] == torch.bfloat16


@pytest.fixture
def one_gpu_process_group():
    """An NCCL group of one process on GPU 0 in an in-process store (FSDP2's collectives on CUDA tensors)."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


@pytest.mark.requires_te
def test_fsdp2_keeps_the_rotary_table_fp32_with_te_layers_on_a_gpu(one_gpu_process_group, monkeypatch):
    """The same probe with TE's layers on a GPU, where TE applies RoPE inside attention (``fused_qkv_rope=false``:
    the table is an argument of the sharded layer); and the control with a casting policy, which the probe catches."""
    device = one_gpu_process_group
    te_rope = ["+model_config_overrides.fused_qkv_rope=false"]
    built = build_fsdp2(bf16_cfg(*te_rope, backend="te"), device)
    assert built.model.backend == "te"
    assert all(p.dtype == torch.float32 for p in built.model.parameters())
    assert what_reaches_the_attention(built, device) == {"hidden": torch.bfloat16, "rotary": torch.float32}
    casting = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    monkeypatch.setattr(model_setup, "mixed_precision_policy", lambda mp_cfg, device: casting)
    casting_built = build_fsdp2(bf16_cfg(*te_rope, backend="te"), device)
    assert what_reaches_the_attention(casting_built, device)["rotary"] == torch.bfloat16


@pytest.mark.requires_te
@pytest.mark.parametrize("layers", [[], ["+model_config_overrides.fused_residual_norm=true"]], ids=["te", "fused"])
def test_fsdp2_rotates_queries_and_keys_with_an_fp32_table_on_a_gpu(one_gpu_process_group, monkeypatch, layers):
    """The GPU default (RoPE inside the QKV projection, for TE's and for the fused layers): the sharded layers get no
    table, and the table the projections rotate with is float32 and equal to one computed in float64 (a bf16 round
    trip on the way would be off by up to 2**-9 relative)."""
    device = one_gpu_process_group
    built = build_fsdp2(bf16_cfg(*layers, backend="te"), device)
    rotary = built.model.esm.encoder.qkv_rotary
    tables = []
    set_batch = rotary.set_batch
    monkeypatch.setattr(
        rotary, "set_batch", lambda positions, freqs=None: (tables.append(freqs), set_batch(positions, freqs))
    )
    layer_tables = []
    layer = built.model.esm.encoder.layers[0]
    handle = layer.register_forward_pre_hook(
        lambda module, args, kwargs: layer_tables.append(kwargs.get("rotary_pos_emb")), with_kwargs=True
    )
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 32, 12, 13, 2]], device=device)
    labels = torch.full_like(input_ids, -100)
    labels[0, 8] = 14
    try:
        assert torch.isfinite(built.train_model(input_ids=input_ids, labels=labels).loss)
    finally:
        handle.remove()
    assert layer_tables == [None]
    (table,) = tables
    assert table.dtype == torch.float32
    head_dim = table.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    exact = torch.outer(torch.arange(table.shape[0], dtype=torch.float64), inv_freq)
    torch.testing.assert_close(
        table.reshape(table.shape[0], -1)[:, : head_dim // 2].double().cpu(), exact, rtol=1e-6, atol=0
    )


def test_bf16_weights_without_fp32_master_weights(one_process_group):
    built = build_fsdp2(bf16_cfg("mixed_precision.fp32_master_weights=false"))
    assert all(p.dtype == torch.bfloat16 for p in built.model.parameters())
    assert what_reaches_the_attention(built)["rotary"] == torch.float32


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], torch.optim.AdamW),  # fp32 master weights on the CPU (on CUDA: CompensatedAdamW, adamw.py)
        (["mixed_precision.fp32_master_weights=false"], CompensatedAdamW),
        (
            ["mixed_precision.fp32_master_weights=false", "mixed_precision.compensate_bf16_updates=false"],
            torch.optim.AdamW,
        ),
    ],
)
def test_bf16_weights_get_the_compensated_optimizer(one_process_group, overrides, expected):
    cfg = bf16_cfg(*overrides)
    built = build_model(cfg, torch.device("cpu"), None, strategy="ddp")
    optimizer = build_optimizer(cfg, built.model, torch.device("cpu"))
    assert type(optimizer) is expected
    assert optimizer.defaults["lr"] == cfg.adamw_kwargs.lr and optimizer.defaults["betas"] == tuple(
        cfg.adamw_kwargs.betas
    )


def test_a_process_alone_trains_without_the_ddp_wrapper(one_process_group):
    """One rank has nothing to average: the wrapper would only copy gradients to its buckets and back."""
    built = build_model(bf16_cfg(), torch.device("cpu"), None, strategy="ddp")
    assert built.ddp is None and built.train_model is built.model
    with built.gradient_sync(False):  # accumulating micro-batches needs no wrapper either
        pass
    assert built.config.num_hidden_layers == 2 and built.plan.layer_precision is None
    assert built.model_flops is not None


def test_several_ranks_get_the_ddp_wrapper(one_process_group, monkeypatch):
    model = build_model(bf16_cfg(), torch.device("cpu"), None, strategy="ddp").model
    assert data_parallel_wrapper(model, torch.device("cpu")) is None
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)  # what it decides on
    ddp = data_parallel_wrapper(model, torch.device("cpu"))
    assert isinstance(ddp, DistributedDataParallel) and ddp.module is model


def test_the_ddp_wrapper_skips_the_per_step_buffer_broadcast(one_process_group):
    """What several ranks get (``data_parallel_wrapper`` calls this when the group has more than one)."""
    model = build_model(bf16_cfg(), torch.device("cpu"), None, strategy="ddp").model
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates DDP's broadcast_buffers
        ddp = wrap_in_ddp(model, torch.device("cpu"))
    assert isinstance(ddp, DistributedDataParallel) and ddp.module is model
    assert not ddp.will_sync_module_buffers()  # the rotary tables never change: no per-step broadcast


def test_unknown_strategy_fails():
    with pytest.raises(ValueError, match="strategy must be one of"):
        build_model(bf16_cfg(), torch.device("cpu"), None, strategy="zero3")


FUSED_CONFIGS = ["L1_650M", "L1_3B", "L1_amplify_120M", "L1_amplify_350M", "L0_sanity_amplify"]
FP4 = ["fp4_config.enabled=true"]
MXFP8 = ["fp8_config.enabled=true", "fp8_config.fp8_recipe=MXFP8BlockScaling"]


def _fused_layer_choice(monkeypatch, caplog, config_name, run_overrides):
    """(fused_residual_norm as the config has it, as the run with ``run_overrides`` gets it)."""
    # The per-layer plan as on a GPU machine; TE's recipe object (not needed here) stands in as None.
    monkeypatch.setattr(
        model_families,
        "build_quantization",
        lambda fp8, fp4, layers: QuantizationPlan(
            resolve_layer_precision(layers, fp8["enabled"], fp8["fp8_layers"], fp4["enabled"], fp4["fp4_layers"])
        ),
    )
    fused = [] if config_name.startswith("L1_") else ["+model_config_overrides.fused_residual_norm=true"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        plain = compose(config_name=config_name, overrides=["output_dir=unused", "dataset.path=x", *fused])
        cfg = compose(
            config_name=config_name, overrides=["output_dir=unused", "dataset.path=x", *fused, *run_overrides]
        )
    as_is, _ = load_model_config(
        plain, OmegaConf.to_container(plain.fp8_config), OmegaConf.to_container(plain.fp4_config)
    )
    with caplog.at_level(logging.WARNING, logger="fused_layer_choice"):
        config, _ = load_model_config(
            cfg, OmegaConf.to_container(cfg.fp8_config), OmegaConf.to_container(cfg.fp4_config)
        )
    return as_is.fused_residual_norm, config.fused_residual_norm


@pytest.mark.parametrize(
    "config_name, run_overrides, reason",
    [
        *[(name, FP4, "this run has FP4 layers") for name in FUSED_CONFIGS],
        ("L1_amplify_120M", [*FP4, "fp4_config.fp4_layers=[1]"], "this run has FP4 layers"),
        *[(name, MXFP8, "not MXFP8BlockScaling") for name in FUSED_CONFIGS],
        *[(name, ["cp_size=2"], "cp_size > 1") for name in FUSED_CONFIGS],
        *[(name, ["use_torch_compile=true"], "use_torch_compile=true") for name in FUSED_CONFIGS],
    ],
)
def test_fused_layers_are_switched_off_where_they_cannot_run(monkeypatch, caplog, config_name, run_overrides, reason):
    """The L1 configs of ESM-2 and AMPLIFY turn fused_residual_norm on (as may a user elsewhere); FP4 layers, FP8 with
    MXFP8 (not run by the fused layers), context parallelism or torch.compile added to such a run get TE's layers and
    one warning that says why, not the model's refusal."""
    as_is, in_run = _fused_layer_choice(monkeypatch, caplog, config_name, run_overrides)
    assert as_is  # on in the config, and kept by a run that can use it
    assert not in_run
    assert "fused_residual_norm is off for this run (TE's layers instead)" in caplog.text and reason in caplog.text


@pytest.mark.parametrize("fp8_recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("fp8_layers", ["all", "[2]"])
@pytest.mark.parametrize("config_name", FUSED_CONFIGS)
def test_fp8_runs_keep_the_fused_layers(monkeypatch, caplog, config_name, fp8_layers, fp8_recipe):
    """The fused layers run FP8 with these recipes (TE's FP8 GEMMs behind the fused norms): no fallback."""
    layers = [] if fp8_layers == "all" else [f"fp8_config.fp8_layers={fp8_layers}"]
    run = ["fp8_config.enabled=true", f"fp8_config.fp8_recipe={fp8_recipe}", *layers]
    assert _fused_layer_choice(monkeypatch, caplog, config_name, run) == (True, True)
    assert "fused_residual_norm is off" not in caplog.text
