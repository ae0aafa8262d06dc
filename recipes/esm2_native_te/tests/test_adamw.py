# Copied from common/tests/test_adamw.py — edit the source, then run ci/check_copies.py --fix
"""adamw.build_adamw: which AdamW a run gets from its config, with what arguments, and the errors a user sees."""

import pytest
import torch
from adamw import build_adamw, megatron_fsdp_init_step_left_out
from compensated_adamw import CompensatedAdamW, join_master, split_float32_masters
from mixed_precision import (
    holds_masters_in_optimizer,
    keeps_fp32_master_weights,
    megatron_fsdp_precision,
    settle_masters_in_optimizer,
)
from omegaconf import OmegaConf
from user_errors import ConfigError


CPU = torch.device("cpu")


def config(
    fp32_master_weights=True,
    compensate=True,
    enabled=True,
    on_cpu=True,
    masters_in_optimizer=None,
    **extra_adamw_kwargs,
):
    cfg = OmegaConf.create(
        {
            "adamw_kwargs": {
                "lr": 4e-4,
                "betas": [0.9, 0.98],
                "eps": 1e-8,
                "weight_decay": 0.01,
                **extra_adamw_kwargs,
            },
            "mixed_precision": {
                "enabled": enabled,
                "on_cpu": on_cpu,
                "fp32_master_weights": fp32_master_weights,
                "compensate_bf16_updates": compensate,
            },
            "grad_acc_steps": 1,
        }
    )
    if masters_in_optimizer is not None:  # the recipes whose config has the key
        cfg.mixed_precision.masters_in_optimizer = masters_in_optimizer
    return cfg


def parameters(dtype=torch.bfloat16):
    return [torch.nn.Parameter(torch.zeros(4, 3, dtype=dtype)), torch.nn.Parameter(torch.zeros(3, dtype=dtype))]


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (config(), torch.optim.AdamW),  # fp32 master weights
        (config(fp32_master_weights=False), CompensatedAdamW),
        (config(fp32_master_weights=False, compensate=False), torch.optim.AdamW),
        (config(fp32_master_weights=False, enabled=False), torch.optim.AdamW),  # no bf16 compute: fp32 weights
        (config(fp32_master_weights=False, on_cpu=False), torch.optim.AdamW),  # bf16 only on CUDA, this is CPU
    ],
)
def test_bf16_weights_get_the_compensated_optimizer(cfg, expected):
    optimizer = build_adamw(parameters(), cfg, CPU)
    assert type(optimizer) is expected
    assert optimizer.defaults["lr"] == 4e-4 and tuple(optimizer.defaults["betas"]) == (0.9, 0.98)
    assert optimizer.defaults["weight_decay"] == 0.01 and optimizer.defaults["eps"] == 1e-8


CUDA = torch.device("cuda")  # only the choice reads it: the parameters stay on the CPU


@pytest.mark.parametrize(
    ("cfg", "expected", "fused"),
    [
        (config(), CompensatedAdamW, None),  # fp32 master weights: the float32 kernel, clipping's factor in its step
        (config(enabled=False), CompensatedAdamW, None),  # no bf16 compute: fp32 weights too
        (config(fused=True), torch.optim.AdamW, True),  # asked for by name
        (config(fused=False), torch.optim.AdamW, False),
        (config(amsgrad=True), torch.optim.AdamW, True),  # an argument CompensatedAdamW lacks: torch's, fused
    ],
    ids=["fp32-master-weights", "no-bf16", "fused-asked", "unfused-asked", "amsgrad"],
)
def test_fp32_weights_on_cuda_get_the_float32_kernel_unless_torchs_adamw_is_asked_for(cfg, expected, fused):
    optimizer = build_adamw(parameters(torch.float32), cfg, CUDA)
    assert type(optimizer) is expected
    assert optimizer.defaults["lr"] == 4e-4 and tuple(optimizer.defaults["betas"]) == (0.9, 0.98)
    if fused is not None:
        assert optimizer.defaults["fused"] is fused
    # on the CPU fp32 weights always get torch's AdamW, unfused (the test suites' training runs)
    assert build_adamw(parameters(torch.float32), config(), CPU).defaults["fused"] is False


def test_parameter_groups_keep_their_own_settings():
    # vectors: their low bits start at zero (matrices start dithered, as an fp32 initialisation leaves them)
    decay, no_decay = (torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2))
    groups = [{"params": [decay]}, {"params": [no_decay], "weight_decay": 0.0}]
    optimizer = build_adamw(groups, config(fp32_master_weights=False), CPU)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    decay.grad, no_decay.grad = torch.zeros_like(decay), torch.zeros_like(no_decay)
    decay.data.fill_(1.0)
    no_decay.data.fill_(1.0)
    optimizer.step()  # zero gradients: only weight decay moves a weight, and only in the first group
    # 1 - lr * weight_decay is below half a bf16 step from 1: the move shows in the fp32 master value, exactly
    # 1 * float32(1 - lr * weight_decay) (a tolerance would let an undecayed 1.0 pass: the step is 4e-6)
    master = [join_master(p.detach(), optimizer.state[p]["compensation"]) for p in (decay, no_decay)]
    assert torch.equal(master[0], torch.full((3,), 1.0 - 4e-4 * 0.01, dtype=torch.float32))
    assert torch.equal(master[1], torch.ones(3))


def test_an_adamw_argument_the_compensated_optimizer_lacks_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"adamw_kwargs\.amsgrad .*compensate_bf16_updates=false"):
        build_adamw(parameters(), config(fp32_master_weights=False, amsgrad=True), CPU)
    # torch's AdamW takes it
    assert build_adamw(parameters(torch.float32), config(amsgrad=True), CPU).defaults["amsgrad"] is True


def test_a_config_without_the_compensation_key_fails_by_name():
    cfg = config(fp32_master_weights=False)
    del cfg.mixed_precision["compensate_bf16_updates"]
    with pytest.raises(Exception, match="compensate_bf16_updates"):
        build_adamw(parameters(), cfg, CPU)


def test_masters_in_the_optimizer_get_float32_moments_and_start_from_the_given_low_bits():
    model = torch.nn.Linear(4, 3)
    weights = [param.detach().clone() for param in model.parameters()]
    low_bits = split_float32_masters(model)
    cfg = config(masters_in_optimizer=True, compensate=False)  # compensate_bf16_updates is for bf16 weights only
    assert holds_masters_in_optimizer(cfg.mixed_precision, CPU)
    assert not keeps_fp32_master_weights(cfg.mixed_precision, CPU)  # no fp32 parameters: the model is bf16
    optimizer = build_adamw(model.parameters(), cfg, CPU, low_bits)
    assert type(optimizer) is CompensatedAdamW and optimizer.state_dtype == torch.float32
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # lr 4e-4, zero gradients: the masters decay by lr * weight_decay, from the float32 init
    for param, weight in zip(model.parameters(), weights):
        state = optimizer.state[param]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
        expected = weight * torch.tensor(1 - 4e-4 * 0.01, dtype=torch.float32)
        assert torch.equal(join_master(param.detach(), state["compensation"]), expected)


def test_masters_in_the_optimizer_need_the_low_bits_and_the_compensated_optimizer():
    cfg = config(masters_in_optimizer=True)
    with pytest.raises(ValueError, match="master_low_bits"):
        build_adamw(parameters(), cfg, CPU)
    with pytest.raises(ConfigError, match=r"adamw_kwargs\.amsgrad .*masters_in_optimizer=false"):
        build_adamw(parameters(), config(masters_in_optimizer=True, amsgrad=True), CPU, {})
    # Off (or no bf16 compute, or no fp32 master weights): the optimizer of those settings.
    assert not holds_masters_in_optimizer(config(masters_in_optimizer=True, on_cpu=False).mixed_precision, CPU)
    assert not holds_masters_in_optimizer(config(False, masters_in_optimizer=True).mixed_precision, CPU)
    assert type(build_adamw(parameters(torch.float32), config(masters_in_optimizer=False), CPU)) is torch.optim.AdamW


@pytest.mark.parametrize("strategy", ["fsdp2", "mfsdp"])
def test_masters_in_the_optimizer_are_switched_off_where_fsdp_keeps_its_own(strategy, caplog):
    cfg = config(masters_in_optimizer=True)
    cfg.grad_acc_steps = 4  # no matter there
    with caplog.at_level("INFO"):
        settle_masters_in_optimizer(cfg, strategy, CPU)
    assert cfg.mixed_precision.masters_in_optimizer is False and keeps_fp32_master_weights(cfg.mixed_precision, CPU)
    assert "is for train_ddp.py" in caplog.text


def test_masters_in_the_optimizer_run_under_ddp_with_one_micro_batch():
    cfg = config(masters_in_optimizer=True)
    settle_masters_in_optimizer(cfg, "ddp", CPU)
    assert cfg.mixed_precision.masters_in_optimizer is True
    cfg.grad_acc_steps = 4
    with pytest.raises(ConfigError, match="needs grad_acc_steps=1"):
        settle_masters_in_optimizer(cfg, "ddp", CPU)
    cfg.mixed_precision.masters_in_optimizer = False
    settle_masters_in_optimizer(cfg, "ddp", CPU)  # off: any number of micro-batches


def shard_like_megatron_fsdp(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """What ``megatron_fsdp.fully_shard`` (0.6) does to the optimizer it is given, without GPUs: its parameter groups
    replaced by one new group of the (sharded) parameters, then one step on zero gradients to build the state."""
    optimizer.param_groups.clear()
    optimizer.state.clear()
    optimizer.add_param_group({"params": params})
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("fp32_master_weights", [True, False], ids=["adamw", "compensated"])
def test_megatron_fsdp_state_building_step_is_left_out(fp32_master_weights):
    """Sharded inside ``megatron_fsdp_init_step_left_out``, the optimizer's first training step equals a fresh
    optimizer's first step bit for bit (weights, moments, step count), and the weights are untouched before it.
    Without it, that first step is bias-corrected as a second one and the weights decay once at sharding (checked, so
    that the test can tell the two apart)."""
    dtype = torch.float32 if fp32_master_weights else torch.bfloat16
    cfg = config(fp32_master_weights=fp32_master_weights, weight_decay=0.1)
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    gradients = [torch.randn(64, 32), torch.randn(32)]

    def first_step(shard: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [torch.nn.Parameter(value.to(dtype, copy=True)) for value in start]
        optimizer = build_adamw(params, cfg, CPU)
        if shard == "left_out":
            with megatron_fsdp_init_step_left_out(optimizer):
                shard_like_megatron_fsdp(optimizer, params)
            assert all(torch.equal(p, v.to(dtype)) for p, v in zip(params, start))
            assert optimizer.param_groups[0]["lr"] == cfg.adamw_kwargs.lr
        elif shard == "plain":
            shard_like_megatron_fsdp(optimizer, params)
        for param, gradient in zip(params, gradients):
            param.grad = gradient.to(dtype)
        optimizer.step()
        return [p.detach().clone() for p in params], [optimizer.state[p]["exp_avg_sq"].clone() for p in params]

    expected_weights, expected_moments = first_step("none")
    weights, moments = first_step("left_out")
    for value, expected in zip([*weights, *moments], [*expected_weights, *expected_moments]):
        assert torch.equal(value, expected)
    plain_weights, _ = first_step("plain")
    assert not all(torch.equal(value, expected) for value, expected in zip(plain_weights, expected_weights))


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (config(), (torch.float32, torch.float32)),  # fp32 main weights and gradients, bf16 compute weights
        (config(fp32_master_weights=False), (None, None)),  # bf16 weights: bf16 gradients, CompensatedAdamW
        (config(fp32_master_weights=False, enabled=False), (torch.float32, torch.float32)),  # float32 throughout
        (config(fp32_master_weights=False, on_cpu=False), (torch.float32, torch.float32)),  # no bf16 on this CPU
    ],
)
def test_megatron_fsdp_keeps_fp32_main_weights_and_gradients_unless_the_weights_are_bf16(cfg, expected):
    """Megatron-FSDP's (main_params_dtype, main_grads_dtype): fp32 main gradients beside bf16 weights would reach the
    optimizer uncast (torch refuses them in the first backward pass); bf16 weights get bf16 gradients, as under
    FSDP2 and DDP."""
    assert megatron_fsdp_precision(cfg.mixed_precision, CPU) == expected
