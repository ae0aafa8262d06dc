"""lightning_module.py and model_setup.py pieces: bf16 mixed precision keeps the rotary table in float32 (Lightning's
autocast for DDP, FSDP2's MixedPrecisionPolicy), FSDP2 computes with bf16 weights over fp32 shards, and dropout seeds
depend on step, micro-batch and rank."""

import json
import logging
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from datamodule import CodonDataModule
from hydra import compose, initialize_config_dir
from launch import RECIPE_DIR
from lightning_module import dropout_seed, module_for
from model_setup import build_model, fsdp2_policy, load_model_config, shard_with_fsdp2
from modeling_codonfm_te import EncodonLayer
from torch.distributed.device_mesh import init_device_mesh
from trainer_setup import build_trainer


def l0_config(*overrides: str):
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        return compose(config_name="L0_sanity", overrides=["output_dir=unused", *overrides])


def record_layer_inputs(model) -> list:
    """(rotary table dtype, the layer's QKV weight dtype during its forward) for every EncodonLayer call."""
    seen = []

    def hook(layer, args, kwargs):
        seen.append((kwargs["rotary"].dtype, layer.self_attention.layernorm_qkv.weight.dtype))

    for module in model.modules():
        if isinstance(module, EncodonLayer):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def batch():
    torch.manual_seed(0)
    input_ids = torch.randint(5, 69, (2, 40))
    labels = torch.full_like(input_ids, -100)
    labels[:, 3] = input_ids[:, 3]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def test_lightning_bf16_autocast_keeps_the_rotary_table_fp32():
    """precision=bf16-mixed under DDP is torch.autocast over fp32 weights; the table the layers rotate with is still
    float32 (bf16 would put positions in the thousands whole radians off)."""
    config, plan = load_model_config(l0_config())
    model = build_model(config, plan, pretraining=True, device="cpu")
    seen = record_layer_inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch(), labeled_logits_only=True).loss
    assert seen == [(torch.float32, torch.float32)] * 2 and loss.dtype == torch.float32


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_fsdp2_computes_in_bf16_from_fp32_shards_with_an_fp32_rotary_table(one_rank_group):
    """strategy=fsdp2 with bf16-mixed: meta-device build, fully_shard per EncodonLayer with the policy, materialised;
    the layers compute with bf16 weights while the stored shards stay fp32, and the rotary table reaches them in fp32
    (the policy never casts forward inputs)."""
    policy = fsdp2_policy("bf16-mixed", torch.device("cpu"))
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    config, plan = load_model_config(l0_config("strategy=fsdp2"))
    model = build_model(config, plan, pretraining=True, device="meta")
    shard_with_fsdp2(model, one_rank_group, policy, reshard_after_forward=True)
    model.init_empty_weights("cpu")
    seen = record_layer_inputs(model)
    loss = model(**batch(), labeled_logits_only=True).loss
    loss.backward()
    assert seen == [(torch.float32, torch.bfloat16)] * 2
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert fsdp2_policy("32-true", torch.device("cpu")).param_dtype is None  # 32-true: no casting at all


def test_dropout_seeds_differ_by_step_micro_batch_and_rank_and_repeat():
    seeds = {dropout_seed(42, step, micro, rank) for step in range(3) for micro in range(2) for rank in range(4)}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)
    assert dropout_seed(42, 5, 1, 3) == dropout_seed(42, 5, 1, 3) != dropout_seed(43, 5, 1, 3)


def test_the_l0_configs_are_tiny_and_cpu_friendly():
    for name in ("L0_sanity", "L0_finetune"):
        with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
            cfg = compose(config_name=name, overrides=["output_dir=unused"])
        assert cfg.trainer.precision == "32-true" and cfg.strategy == "ddp"
        assert cfg.model_config_overrides.hidden_size == 128 and os.path.isfile(RECIPE_DIR / cfg.data.train_path)


def fit_l0_steps(output_dir, calibrate: bool) -> list[dict]:
    """Three logged steps of the L0 pre-training run in this process, with the DelayedScaling calibration forced on
    (``calibrate``; on the CPU no FP8 scale exists, so its passes run and set nothing) or off."""
    cfg = l0_config(
        f"output_dir={output_dir}",
        "num_train_steps=3",
        "logger.log_every=1",
        "trainer.accumulate_grad_batches=2",
        "model_config_overrides.hidden_dropout_prob=0.1",  # the passes run with dropout, as training does
        "checkpoint.save_final=false",
        "export_final_model=false",
    )
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = module_for(cfg)
    module._calibrate_fp8_scales = calibrate  # as a DelayedScaling plan with calibrate_delayed_scaling=true sets it
    build_trainer(cfg).fit(module, datamodule=CodonDataModule(cfg.data))
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_calibration_passes_run_through_the_strategy_and_leave_the_run_unchanged(tmp_path, caplog):
    """The passes (fp8_calibration.py) run the first micro-batch's training_step through Lightning's strategy and
    backward inside the fit, and the run's losses and gradient norms are those of a run without them. (Lightning
    itself zeroes the gradients before a step's first micro-batch and on_train_batch_start reseeds dropout after the
    passes, so this checks the Lightning side; common/tests/test_fp8_calibration.py checks the discarding and the
    RNG.)"""
    plain = fit_l0_steps(tmp_path / "plain", calibrate=False)
    with caplog.at_level(logging.INFO):
        calibrated = fit_l0_steps(tmp_path / "calibrated", calibrate=True)
    assert "DelayedScaling: 2 forward/backward passes on the first batch" in caplog.text
    assert [m["step"] for m in plain] == [1, 2, 3]
    assert [(m["loss"], m["grad_norm"]) for m in calibrated] == [(m["loss"], m["grad_norm"]) for m in plain]
