"""The training scripts on GPUs with the TransformerEngine backend (skipped on machines without them).

References are those of the CPU tests: the loss must fall below ln 4 (which needs context) and the export must load
with the checkpoint's logits.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from compensated_adamw import split_master
from dataset import held_out_batches
from launch import RECIPE_DIR, run_script
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_train import FAST, LOSS_THRESHOLD, assert_validation_learns, read_metrics
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from validation import Validator


VALIDATE = "validation.every_n_steps=40"  # L0_sanity's held-out file at steps 40 and 80
# TE's fused attention runs a deterministic backward only when asked to; GEMMs and norms are run-to-run exact. With it,
# two TE runs of the same steps log the same losses bit for bit.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def train_on_gpu(
    script: str, output_dir: Path, *overrides: str, nproc: int | None = None, env: dict | None = None
) -> list[dict]:
    args = [f"output_dir={output_dir}", *FAST, "num_train_steps=80", *overrides]
    run_script(script, *args, nproc=nproc, cpu_only=False, env=env)
    return read_metrics(output_dir)


def assert_learned(metrics: list[dict], threshold: float = LOSS_THRESHOLD) -> None:
    assert metrics[-1]["loss"] < threshold, [round(m["loss"], 3) for m in metrics]


def assert_validation_is_the_exports(output_dir: Path, input_format: str, micro_batch_size: int = 1) -> None:
    """The TE run's last validation loss is what one process on CPU computes for its export (torch backend, fp32)
    on the same held-out windows, to bf16 precision."""
    last = read_metrics(output_dir, "validation.jsonl")[-1]
    data_cfg = {"path": "unused", "max_seq_length": 128, "window_overlap": 0, "token_budget": 1024}
    data_cfg.update(input_format=input_format, micro_batch_size=micro_batch_size)  # the runs' settings (L0 + FAST)
    tokenizer = AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer")
    export_dir = output_dir / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    model = AutoModelForCausalLM.from_pretrained(export_dir, config=config, trust_remote_code=True).float()
    val_cfg = OmegaConf.create({"path": str(RECIPE_DIR / "data/sanity_dna_valid.fasta"), "every_n_steps": 1})
    one_process = Validator(
        OmegaConf.merge(val_cfg, {"max_batches": None}),
        lambda path: held_out_batches(path, data_cfg, tokenizer),
        dp_rank=0,
        device=torch.device("cpu"),
        output_dir=output_dir / "one_process",
    ).run(model, step=last["step"])
    assert one_process["val_tokens"] == last["val_tokens"]
    assert one_process["val_loss"] == pytest.approx(last["val_loss"], rel=0.02, abs=0.01)


@pytest.mark.requires_te
@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train_ddp.py", ["dataset.input_format=bshd", "dataset.micro_batch_size=8"]),
        ("train_fsdp2.py", ["dataset.input_format=thd"]),
        # bf16 weights, sharded: CompensatedAdamW's Triton kernel updates each local shard.
        ("train_fsdp2.py", ["dataset.input_format=thd", "mixed_precision.fp32_master_weights=false"]),
        # FusedResidualTransformerLayer (GQA, causal, RoPE in the QKV buffer), packed and padded input.
        ("train_ddp.py", ["dataset.input_format=thd", "+model_config_overrides.fused_residual_norm=true"]),
        ("train_fsdp2.py", ["dataset.input_format=bshd", "+model_config_overrides.fused_residual_norm=true"]),
    ],
    ids=["ddp-bshd", "fsdp2-thd", "fsdp2-thd-bf16-weights", "ddp-thd-fused", "fsdp2-bshd-fused"],
)
def test_te_backend_learns(tmp_path, script, overrides):
    metrics = train_on_gpu(script, tmp_path, "+model_config_overrides.backend=te", VALIDATE, *overrides)
    assert_learned(metrics)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gb"] > 0
    assert (tmp_path / "final_model" / "model.safetensors").is_file()
    assert_validation_learns(tmp_path, [40, 80])
    settings = dict(o.removeprefix("dataset.").split("=") for o in overrides if o.startswith("dataset."))
    assert_validation_is_the_exports(tmp_path, settings["input_format"], int(settings.get("micro_batch_size", 1)))


@pytest.mark.requires_te
def test_fp32_masters_held_in_the_optimizer_train_as_fp32_weights_do_with_te(tmp_path):
    """``mixed_precision.masters_in_optimizer`` with the fused TE layers (bf16 weights into TE's GEMMs, the Triton
    CompensatedAdamW kernel from the float32 init's low bits, float32 moments) against fp32 weights cast per GEMM,
    both through train_ddp.py with deterministic attention: the losses agree to 0.02 at every logged step, and the
    export holds float32 weights whose split (as the optimizer splits them) is the checkpoint's bf16 weights."""
    common = [
        "+model_config_overrides.backend=te",
        "+model_config_overrides.fused_residual_norm=true",
        "dataset.input_format=thd",
        "adamw_kwargs.lr=1e-3",
        "num_train_steps=40",
        "logger.log_every=5",
        "validation.path=null",
    ]
    runs = {
        name: train_on_gpu(
            "train_ddp.py", tmp_path / name, *common, f"mixed_precision.masters_in_optimizer={on}", env=DETERMINISTIC
        )
        for name, on in [("fp32", "false"), ("split", "true")]
    }
    assert [m["step"] for m in runs["split"]] == [m["step"] for m in runs["fp32"]] == list(range(5, 41, 5))
    for fp32, split in zip(runs["fp32"], runs["split"]):
        assert abs(fp32["loss"] - split["loss"]) < 0.02, runs
    assert runs["split"][-1]["loss"] < runs["split"][0]["loss"] - 2.0, runs["split"]
    model_state = torch.load(tmp_path / "split/checkpoints/step_40/train_state.pt", weights_only=True)["model"]
    exported = load_file(tmp_path / "split/final_model/model.safetensors")
    for name, weight in exported.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(split_master(weight)[0], model_state[name].cpu()), name


@pytest.mark.requires_te
def test_evaluation_script_scores_a_te_checkpoint_as_its_export_on_cpu(tmp_path):
    """scripts/evaluate_fasta_lm_loss.py on an FSDP2 TE run: its last DCP checkpoint with TE in bf16 on the GPU and
    its export with the torch backend in fp32 on CPU give the same token-weighted NLL, to bf16 precision."""
    train_on_gpu("train_fsdp2.py", tmp_path, "+model_config_overrides.backend=te", "dataset.input_format=thd")

    def evaluate(checkpoint: Path, output: Path, *args: str) -> dict:
        fasta = RECIPE_DIR / "data/sanity_dna_valid.fasta"
        script_args = [str(checkpoint), str(fasta), "--window-length", "128", "--output", str(output), *args]
        run_script("scripts/evaluate_fasta_lm_loss.py", *script_args, cpu_only="cpu" in args)
        return json.loads(output.read_text())

    on_gpu = evaluate(tmp_path / "checkpoints/step_80", tmp_path / "gpu.json", "--backend", "te", "--device", "cuda")
    on_cpu = evaluate(tmp_path / "final_model", tmp_path / "cpu.json", "--backend", "torch", "--device", "cpu")
    assert on_gpu["precision"] == "bf16" and on_gpu["token_weighted_nll"] < LOSS_THRESHOLD
    assert on_gpu["token_weighted_nll"] == pytest.approx(on_cpu["token_weighted_nll"], abs=0.03)


FUSED_LAYERS_LOG = "(FusedResidualTransformerLayer: residual adds in the RMSNorm kernels, RoPE in the QKV buffer)"


@pytest.mark.requires_fp8
@pytest.mark.parametrize(
    ("recipe", "layers"),
    [
        ("Float8CurrentScaling", "te"),
        ("Float8BlockScaling", "te"),
        # The fused layers in FP8, as L1_1B_perf and og2_1b_thd build them with fp8_config.enabled=true.
        ("DelayedScaling", "fused"),
        ("Float8CurrentScaling", "fused"),
    ],
)
def test_fp8_learns(tmp_path, recipe, layers):
    overrides = ["fp8_config.enabled=true", f"fp8_config.fp8_recipe={recipe}", "+model_config_overrides.backend=te"]
    if layers == "fused":
        overrides.append("+model_config_overrides.fused_residual_norm=true")
    args = [f"output_dir={tmp_path}", *FAST, "num_train_steps=80", *overrides, VALIDATE]
    log = run_script("train_fsdp2.py", *args, cpu_only=False)
    log = log.stdout + log.stderr
    assert (FUSED_LAYERS_LOG in log) == (layers == "fused"), log[-3000:]  # no fallback to TE's layers
    assert "fused_residual_norm is off" not in log, log[-3000:]
    if recipe == "DelayedScaling":  # fp8_calibration.py: every gradient scale set before step 1, 4 GEMMs x 2 layers
        assert re.search(r"DelayedScaling: [2-5] forward/backward passes .* set 8 gradient scales before step 1", log)
    assert_learned(read_metrics(tmp_path), threshold=1.3)
    held_out = read_metrics(tmp_path, "validation.jsonl")  # the held-out pass under FP8 (no_grad, eval)
    assert [v["step"] for v in held_out] == [40, 80], held_out
    assert held_out[1]["val_loss"] < min(held_out[0]["val_loss"], 1.386), held_out  # below ln 4: uses context


@pytest.mark.requires_te
def test_activation_recompute_with_te_trains_exactly_like_keeping_activations(tmp_path):
    """Both layers recomputed in backward under FSDP2 (TE, THD, causal; TE's attention asked for its deterministic
    backward): the same losses and gradient norms as keeping the activations, bit for bit, and a lower peak memory."""
    common = ["+model_config_overrides.backend=te", "dataset.input_format=thd", "num_train_steps=30"]
    common += ["logger.log_every=1"]
    plain = train_on_gpu("train_fsdp2.py", tmp_path / "plain", *common, env=DETERMINISTIC)
    recompute = [*common, "+model_config_overrides.recompute_layers=2"]
    recomputed = train_on_gpu("train_fsdp2.py", tmp_path / "recompute", *recompute, env=DETERMINISTIC)
    assert [m["loss"] for m in recomputed] == [m["loss"] for m in plain]
    assert [m["grad_norm"] for m in recomputed] == [m["grad_norm"] for m in plain]
    assert plain[-1]["loss"] < plain[0]["loss"] - 1.0  # the run did train
    peak = {
        run: json.loads((tmp_path / run / "summary.json").read_text())["peak_memory_gb"]
        for run in ("plain", "recompute")
    }
    assert peak["recompute"] < peak["plain"], peak


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_two_gpus_fsdp2_learns(tmp_path):
    assert_learned(train_on_gpu("train_fsdp2.py", tmp_path, "dataset.input_format=thd", nproc=2))


@pytest.mark.requires_multi_gpu
@pytest.mark.requires_te
def test_context_parallel_two_gpus_learns_and_exports(tmp_path):
    """TE ring attention (cp_size=2, THD) on 2 GPUs; the CPU twin of this test proves CP = one process numerically."""
    metrics = train_on_gpu("train_cp.py", tmp_path, "model_config_overrides.backend=te", "cp_size=2", nproc=2)
    assert_learned(metrics)
    assert (tmp_path / "final_model" / "model.safetensors").is_file()
