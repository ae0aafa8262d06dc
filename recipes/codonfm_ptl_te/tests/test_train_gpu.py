"""train.py and predict.py on a GPU with the TransformerEngine backend (skipped on machines without them).

The references are the CPU tests' own: the validation loss of the L0 sanity run must come close to the Bayes-optimal
loss of the synthetic data and far below its unigram entropy, and the export must hold the checkpointed weights.
Each strategy (DDP, FSDP, FSDP2) runs bf16 on one GPU; FP8 runs with two TE recipes; two GPUs run DDP, FSDP and FSDP2;
the benchmark configs run a few steps at full size; FSDP1 and FSDP2 decay only the weight matrices (the CPU tests'
one-step reference of tests/test_weight_decay.py). Each L0 run takes about a minute on one H100 (600 Lightning steps
of a tiny model plus start-up), so the one-GPU tests take about 10 minutes; the 2-GPU tests skip there.
"""

import json
import re

import pytest
import torch
from launch import RECIPE_DIR, run_script
from safetensors.torch import load_file
from test_train import read_jsonl
from test_weight_decay import LR, WEIGHT_DECAY, assert_decayed_once, assert_logged_groups, one_decay_step


TE = ["+model_config_overrides.backend=te", "trainer.precision=bf16-mixed"]
UNIGRAM_ENTROPY, OPTIMUM = 3.80, 0.09  # sanity_reference.py on data/sanity_val.parquet (test_train.py computes them)


def train_on_gpu(output_dir, *overrides, nproc=None, config=None) -> dict:
    config_name = ["--config-name", config] if config else []
    run_script(
        "train.py", *config_name, f"output_dir={output_dir}", *overrides, nproc=nproc, cpu_only=False, timeout=600
    )
    return json.loads((output_dir / "summary.json").read_text())


def final_val_loss(output_dir) -> float:
    return read_jsonl(output_dir / "val_metrics.jsonl")[-1]["val_loss"]


def assert_export_holds_the_checkpoint(output_dir) -> None:
    """Every exported tensor equals the one in last.ckpt (TE's _extra_state stays behind), and the export loads."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    exported = load_file(output_dir / "final_model" / "model.safetensors")
    state = torch.load(output_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    saved = {
        k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.") and "_extra_state" not in k
    }
    assert exported.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)
    config = AutoConfig.from_pretrained(output_dir / "final_model", trust_remote_code=True)
    assert config.backend == "auto" and config.layer_precision is None
    model = AutoModelForMaskedLM.from_pretrained(output_dir / "final_model", trust_remote_code=True).cuda().eval()
    assert model.backend == "te"
    ids = torch.tensor([[0, 19, 5, 26, 4, 53, 1]], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.requires_te
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_te_bf16_learns_and_exports_on_one_gpu(tmp_path, strategy):
    summary = train_on_gpu(tmp_path, *TE, f"strategy={strategy}")
    final = final_val_loss(tmp_path)
    assert final < OPTIMUM + 0.3 and final < UNIGRAM_ENTROPY - 3.0, final
    assert summary["precision"] == "bf16-mixed" and summary["strategy"] == strategy
    assert summary["peak_memory_gb"] > 0 and summary["median_mfu"] > 0
    assert_export_holds_the_checkpoint(tmp_path)


@pytest.mark.requires_te
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_te_resume_is_exact(tmp_path, strategy):
    """One GPU with TE and bf16: 20 steps in one go equal 10 + relaunch + 10 (losses within bf16 kernel determinism:
    TE's fused attention backward is not bitwise deterministic, so a tolerance). The checkpoints hold no TE
    `_extra_state`, which FSDP2's load would otherwise hand TE as a placeholder (checkpoint_io.py)."""
    common = [
        *TE,
        f"strategy={strategy}",
        "logger.log_every=1",
        "checkpoint.save_every=10",
        "trainer.val_check_interval=1000",
    ]
    common += ["model_config_overrides.hidden_dropout_prob=0.1"]
    train_on_gpu(tmp_path / "full", *common, "num_train_steps=20")
    train_on_gpu(tmp_path / "resumed", *common, "num_train_steps=10")
    train_on_gpu(tmp_path / "resumed", *common, "num_train_steps=20")
    full, resumed = read_jsonl(tmp_path / "full" / "metrics.jsonl"), read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, 21))
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in full], rel=2e-3)


@pytest.mark.requires_te
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_te_activation_recompute_trains_exactly_like_keeping_activations(tmp_path, strategy):
    """``recompute_layers=2`` (every layer of the L0 model) through Lightning on one GPU with TE and bf16, dropout on
    (the recompute must draw the same masks): the same losses and gradient norms, step by step, bit for bit. Two runs
    of the same steps are compared exactly only with deterministic kernels: TE's fused attention backward and, through
    Lightning's ``deterministic``, torch's (without it the DDP pair once differed in the 6th digit of a gradient norm,
    with equal losses)."""
    common = [
        *TE,
        f"strategy={strategy}",
        "logger.log_every=1",
        "num_train_steps=12",
        "trainer.val_check_interval=1000",
        "+trainer.deterministic=warn",
    ]
    common += [
        "model_config_overrides.hidden_dropout_prob=0.1",
        "model_config_overrides.attention_probs_dropout_prob=0.1",
    ]
    deterministic = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    logs = {}
    for run, extra in (("plain", []), ("recompute", ["+model_config_overrides.recompute_layers=2"])):
        result = run_script(
            "train.py", f"output_dir={tmp_path / run}", *common, *extra, cpu_only=False, timeout=600, env=deterministic
        )
        logs[run] = result.stdout + result.stderr
    assert "activations of 2 of 2 layers recomputed in backward" in logs["recompute"]
    assert "recomputed in backward" not in logs["plain"]
    plain, recomputed = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("plain", "recompute"))
    assert [m["step"] for m in recomputed] == list(range(1, 13))
    assert [(m["loss"], m["grad_norm"]) for m in recomputed] == [(m["loss"], m["grad_norm"]) for m in plain]
    assert plain[-1]["loss"] != plain[0]["loss"]


@pytest.mark.requires_te
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_te_layers_decay_only_the_weight_matrices(tmp_path, strategy):
    """One step in which only weight decay moves a weight (tests/test_weight_decay.py's ``one_decay_step``: a step,
    then a relaunch whose step has eps=1e10), with TE's layers, whose fused LayerNorm weights and biases
    (LayerNormLinear, LayerNormMLP) are among the undecayed, bf16-mixed over fp32 weights, on one GPU: only the weight
    matrices and the embedding table shrink, by lr * weight_decay. FSDP1 (``fsdp``) splits the groups by the names
    configure_model recorded (on one GPU it keeps each tensor's shape, NO_SHARD; two GPUs below give it flat shards);
    FSDP2 by the DTensors' dimensions. Also resumes both groups under FSDP1."""
    before, after, log = one_decay_step(tmp_path, *TE, f"strategy={strategy}", cpu_only=False)
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY)
    assert_logged_groups(log)


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_te_fsdp1_on_two_gpus_decays_only_the_weight_matrices(tmp_path):
    """As above under FSDP1 on two GPUs, where each parameter configure_optimizers sees is a flat 1-D view of this
    rank's shard (maybe empty): the names recorded before wrapping decide."""
    before, after, log = one_decay_step(tmp_path, *TE, "strategy=fsdp", nproc=2, cpu_only=False)
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY)
    assert_logged_groups(log)


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8BlockScaling"])
def test_fp8_layers_learn(tmp_path, recipe):
    """Every layer in FP8 (the model's own te.autocast per layer), inside Lightning's bf16 autocast; THD batches are
    padded to 16 tokens by the model. DelayedScaling first sets the 4 quantized gradients' scales (QKV, proj, fc1,
    fc2) of both layers on the first batch (fp8_calibration.py, on by default); the other recipes need no such step."""
    fp8 = ["fp8_config.enabled=true", f"fp8_config.fp8_recipe={recipe}"]
    result = run_script("train.py", f"output_dir={tmp_path}", *TE, *fp8, cpu_only=False, timeout=600)
    log = result.stdout + result.stderr
    calibrated = re.search(
        r"DelayedScaling: [2-5] forward/backward passes .* set 8 gradient scales before step 1", log
    )
    assert bool(calibrated) == (recipe == "DelayedScaling"), log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["fp8_layers"] == [1, 2]
    final = final_val_loss(tmp_path)
    assert final < OPTIMUM + 0.5 and final < UNIGRAM_ENTROPY - 3.0, final
    assert_export_holds_the_checkpoint(tmp_path)


@pytest.mark.requires_fp8
@pytest.mark.parametrize(("config", "fp8"), [("encodon_80m", False), ("encodon_80m", True), ("encodon_600m", True)])
def test_benchmark_configs_run_at_full_size(tmp_path, config, fp8):
    """A few steps of the full-size shapes (the benchmark configs) on the shipped sequences, to the export."""
    overrides = ["data.train_path=data/sanity_train.parquet", "num_train_steps=10", "logger.log_every=1"]
    overrides += ["lr_scheduler_kwargs.num_warmup_steps=2", "fp8_config.enabled=true"] if fp8 else []
    summary = train_on_gpu(tmp_path, *overrides, config=config)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[-1]["step"] == 10 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (
        summary["median_tokens_per_second_per_gpu"] > 0 and (tmp_path / "final_model" / "model.safetensors").is_file()
    )


@pytest.mark.requires_te
def test_predict_on_gpu_matches_cpu(tmp_path):
    """predict.py with TE on the GPU (float32) and with the torch backend on the CPU give the same PLLs and embeddings."""
    import numpy as np
    import pyarrow.parquet as pq

    train_on_gpu(tmp_path / "run", *TE, "num_train_steps=50", "trainer.val_check_interval=1000")
    sequences = tmp_path / "sequences.parquet"
    pq.write_table(pq.read_table(RECIPE_DIR / "data" / "sanity_val.parquet").slice(0, 24), sequences)
    outputs = {}
    for device, extra in (("gpu", ["backend=te"]), ("cpu", ["backend=torch", "trainer.accelerator=cpu"])):
        out = tmp_path / device
        run_script(
            "predict.py", f"model_path={tmp_path / 'run' / 'final_model'}", f"data.predict_path={sequences}",
            f"output_dir={out}", *extra, cpu_only=device == "cpu", timeout=600,
        )  # fmt: skip
        outputs[device] = (
            pq.read_table(out / "predictions.parquet").column("pll").to_numpy(),
            np.load(out / "embeddings.npy"),
        )
    np.testing.assert_allclose(outputs["gpu"][0], outputs["cpu"][0], rtol=2e-3)
    np.testing.assert_allclose(outputs["gpu"][1], outputs["cpu"][1], rtol=2e-2, atol=2e-3)


@pytest.mark.requires_multi_gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_two_gpus_learn(tmp_path, strategy):
    summary = train_on_gpu(tmp_path, *TE, f"strategy={strategy}", nproc=2)
    assert summary["world_size"] == 2
    assert final_val_loss(tmp_path) < UNIGRAM_ENTROPY - 3.0
    assert_export_holds_the_checkpoint(tmp_path)
