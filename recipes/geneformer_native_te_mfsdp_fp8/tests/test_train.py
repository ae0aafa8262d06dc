"""End-to-end runs of the training scripts on CPU, launched the way a user launches them.

The L0 sanity model (2 layers, hidden 128) trains on the shipped synthetic cells. References are independent of the
code under test: the loss must fall well below the masked genes' unigram entropy (which needs the rest of the cell,
see scripts/make_sanity_dataset.py), an interrupted run must match an uninterrupted one bit for bit, k micro-batches
must equal one batch k times larger, the export must reproduce the weights that the checkpoint holds, and the held-out
loss a run logs must be what one process computes for its export.
"""

import json
import runpy
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dataset import held_out_batches
from launch import RECIPE_DIR, assert_logs_read_well_off_a_terminal, run_script
from modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer
from validation import Validator


FAST = ["dataset.max_seq_length=256", "dataset.micro_batch_size=48", "dataset.token_budget=2048"]
FAST_BATCHING = {"max_seq_length": 256, "micro_batch_size": 48, "token_budget": 2048}  # FAST, for held_out_batches
CONVERGE = [
    "num_train_steps=80",
    "adamw_kwargs.lr=3e-3",
    "lr_scheduler_kwargs.num_warmup_steps=10",
    "lr_scheduler_kwargs.num_decay_steps=70",
    "logger.log_every=10",
]
# The shipped cells' masked genes have a unigram entropy of UNIGRAM_ENTROPY nats (scripts/make_sanity_dataset.py):
# a model that predicts genes without looking at the rest of the cell cannot get below it. Training must.
UNIGRAM_ENTROPY = 5.87
LOSS_THRESHOLD = UNIGRAM_ENTROPY - 1.0
# Held-out loss at steps 40 and 80 on the shipped held-out cells (200 cells; a few forward passes per rank).
HELD_OUT = "data/sanity_cells_val.parquet"
VALIDATE = [f"validation.path={HELD_OUT}", "validation.every_n_steps=40"]


def train(script: str, output_dir: Path, *overrides: str, nproc: int | None = None) -> list[dict]:
    result = run_script(script, f"output_dir={output_dir}", *FAST, *overrides, nproc=nproc)
    assert_logs_read_well_off_a_terminal(result)
    return read_metrics(output_dir)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def load_export(output_dir: Path):
    """The exported model on CPU with the torch backend, also on a GPU machine (where "auto" would pick TE)."""
    export_dir = output_dir / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    return AutoModelForMaskedLM.from_pretrained(export_dir, config=config, trust_remote_code=True)


def checkpoint_weights(step_dir: Path, config) -> torch.nn.Module:
    """The weights a training checkpoint holds, read by plain torch/DCP code rather than the export path."""
    model = NVGeneformerForMaskedLM(config)
    if (step_dir / "train_state.pt").exists():  # DDP
        model.load_state_dict(torch.load(step_dir / "train_state.pt", weights_only=True)["model"])
    else:  # FSDP2 / Megatron-FSDP: a DCP directory, read without a process group
        saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        prefix = "model.module." if any(key.startswith("model.module.") for key in saved) else "model."
        weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        state = {prefix + k: v for k, v in weights.items()}
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
        missing, unexpected = model.load_state_dict(
            {k.removeprefix(prefix): v for k, v in state.items()}, strict=False
        )
        assert not unexpected and all(key.endswith("_extra_state") for key in missing), (missing, unexpected)
    return model.eval()


def sanity_cells(count: int = 4, length: int = 100) -> list[str]:
    cells = pq.read_table(RECIPE_DIR / "data" / "sanity_cells.parquet").column("input_ids").to_pylist()
    return [" ".join(map(str, cell[:length])) for cell in cells[:count]]


def assert_export_reproduces_checkpoint(output_dir: Path, step: int) -> None:
    """Both models on CPU with the torch backend; the export's own tokenizer reads the cells."""
    export_dir = output_dir / "final_model"
    exported = load_export(output_dir).eval()
    assert exported.backend == "torch"
    config = NVGeneformerConfig.from_pretrained(export_dir, backend="torch")
    reference = checkpoint_weights(output_dir / "checkpoints" / f"step_{step}", config)
    # A run with bf16 weights exports bf16 tensors (and its config builds some of the reference's in bf16): the
    # values are what must match, so both models compute in float32.
    exported, reference = exported.float(), reference.float()
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    batch = tokenizer(sanity_cells(), return_tensors="pt", padding=True)
    # The export holds the checkpoint's weights bit for bit. Its logits then match to float32 rounding only: CPU GEMMs
    # may pick other kernels for differently aligned buffers (safetensors loads are not 64-byte aligned), and on some
    # CPUs the rounding grew to 3e-4 on logits of size 6 through the layers. Re-allocating the export's tensors gives
    # both models the same alignment; the tolerance stays at float32-accumulation size for CPUs that differ anyway.
    for key, value in reference.state_dict().items():
        if not key.endswith("_extra_state"):
            torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        for tensor in [*exported.parameters(), *exported.buffers()]:
            tensor.data = tensor.data.clone()
        torch.testing.assert_close(exported(**batch).logits, reference(**batch).logits, rtol=1e-4, atol=1e-3)


def validation_records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "validation.jsonl").read_text().splitlines()]


def assert_validation_is_the_exports_held_out_loss(
    output_dir: Path, steps: list[int], batching: dict, input_format: str, rel: float = 1e-4
) -> None:
    """validation.jsonl holds ``steps``; the held-out loss falls, to below the unigram entropy by more than a nat on
    cells the run never trained on; and its last value is what one process computes on CPU for the exported model
    (full MLM head, float32) on the same held-out batches (``batching``: the run's dataset settings; the seed is 42),
    where the run's validation was split over ranks, or ran on TE in bf16."""
    records = validation_records(output_dir)
    assert [r["step"] for r in records] == steps
    assert records[-1]["val_loss"] < min(records[0]["val_loss"], LOSS_THRESHOLD), records
    exported = load_export(output_dir).float()
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "final_model")
    data_cfg = {"path": "unused", "input_format": input_format, **batching}
    one_process = Validator(
        OmegaConf.create({"path": str(RECIPE_DIR / HELD_OUT), "every_n_steps": 1, "max_batches": None}),
        lambda path: held_out_batches(path, data_cfg, tokenizer, seed=42),
        dp_rank=0,
        device=torch.device("cpu"),
        output_dir=output_dir / "one_process",
    ).run(exported, step=steps[-1])
    assert one_process["val_tokens"] == records[-1]["val_tokens"]
    assert one_process["val_loss"] == pytest.approx(records[-1]["val_loss"], rel=rel)


def assert_same_as_one_larger_batch(accumulated_dir: Path, single_dir: Path) -> None:
    """A run of k micro-batches a step and one of a k times larger batch: the same losses, gradient norms and exported
    weights to float32 rounding, over steps that did change the weights."""
    accumulated, single = read_metrics(accumulated_dir), read_metrics(single_dir)
    assert [m["loss"] for m in accumulated] == pytest.approx([m["loss"] for m in single], rel=1e-5)
    assert [m["grad_norm"] for m in accumulated] == pytest.approx([m["grad_norm"] for m in single], rel=1e-4)
    assert single[-1]["loss"] != single[0]["loss"]  # the steps did change the weights
    expected = load_export(single_dir).state_dict()
    for key, value in load_export(accumulated_dir).state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)


def assert_converged(metrics: list[dict], steps: int) -> None:
    assert metrics[0]["loss"] > 6.5  # a random model starts near ln(1024) = 6.9 (L0_sanity's vocabulary)
    assert metrics[-1]["step"] == steps
    last = [m["loss"] for m in metrics if m["step"] > steps - 20]
    assert sum(last) / len(last) < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]


@pytest.mark.parametrize(
    ("script", "nproc", "input_format"),
    [
        ("train_ddp.py", None, "bshd"),
        ("train_ddp.py", 2, "thd"),
        ("train_fsdp2.py", None, "thd"),
        ("train_fsdp2.py", 2, "bshd"),
    ],
)
def test_l0_sanity_converges_and_exports(tmp_path, script, nproc, input_format):
    """... and scores the held-out cells: at L0_sanity's step 75, or on two processes every 40 steps (split over the
    ranks), equal to one process's evaluation of the export."""
    validate = VALIDATE if nproc else []
    metrics = train(
        script,
        tmp_path,
        *CONVERGE,
        *validate,
        f"dataset.input_format={input_format}",
        "dataset.num_workers=0",
        nproc=nproc,
    )
    assert_converged(metrics, steps=80)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == (nproc or 1) and summary["steps"] == 80
    assert summary["median_tokens_per_second_per_gpu"] > 0
    assert_export_reproduces_checkpoint(tmp_path, step=80)
    if validate:
        assert_validation_is_the_exports_held_out_loss(tmp_path, [40, 80], FAST_BATCHING, input_format)
    else:  # L0_sanity's own schedule: every 75 steps
        assert [r["step"] for r in validation_records(tmp_path)] == [75]


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        # DDP with gradient accumulation and a dataloader worker process; step 20 is a periodic save.
        ("train_ddp.py", ["dataset.input_format=bshd", "grad_acc_steps=2", "dataset.num_workers=1"]),
        # FSDP2 with packed cells and asynchronous checkpoints.
        ("train_fsdp2.py", ["dataset.input_format=thd", "checkpoint.async_save=true", "dataset.num_workers=0"]),
    ],
)
def test_stop_and_go_matches_uninterrupted_run(tmp_path, script, extra, write_cells):
    """40 steps in one go vs 40 steps whose step-40 checkpoint is then lost (a job killed after its last validation,
    before that checkpoint was complete) + resume from step 20 + 20 again: identical losses, gradient norms, final
    weights and held-out losses, each step's logged once. The held-out file has one cell, so on these two ranks rank 1
    runs the placeholder batch at every evaluation."""
    one_cell = write_cells([list(range(100, 140))], name="held_out.parquet")
    validate = [f"validation.path={one_cell}", "validation.every_n_steps=20"]
    common = [*CONVERGE, "num_train_steps=40", "logger.log_every=1", "checkpoint.save_every=20", *validate, *extra]
    full = train(script, tmp_path / "full", *common, nproc=2)
    train(script, tmp_path / "resumed", *common, nproc=2)
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_40")
    resumed = train(script, tmp_path / "resumed", *common, nproc=2)  # same output dir: resumes from step 20

    assert_export_reproduces_checkpoint(tmp_path / "full", step=40)
    assert [m["step"] for m in resumed] == list(range(1, 41))  # steps 21-40 logged once, by the resumed job
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full]  # bit-identical, not just close
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in full]
    assert validation_records(tmp_path / "resumed") == validation_records(tmp_path / "full")
    assert [r["step"] for r in validation_records(tmp_path / "full")] == [20, 40]
    assert full[-1]["loss"] < full[0]["loss"] - 1.0  # and the run did train
    resumed_state = load_export(tmp_path / "resumed").state_dict()
    for name, value in load_export(tmp_path / "full").state_dict().items():
        torch.testing.assert_close(resumed_state[name], value, rtol=0, atol=0, msg=name)


def test_resume_on_one_rank_continues_a_two_rank_run(tmp_path):
    """DDP with packed cells: 20 steps on 2 processes, then the same command on 1 process resumes them, reads the
    epoch's cells that neither rank had read (the log says how many), trains to 40 and exports the final checkpoint's
    weights. (Row by row: tests/test_epoch_batch_sampler.py.)"""
    common = [
        *CONVERGE,
        "num_train_steps=40",
        "logger.log_every=1",
        "dataset.input_format=thd",
        "dataset.num_workers=0",
    ]
    train("train_ddp.py", tmp_path, *common, "num_train_steps=20", nproc=2)
    result = run_script("train_ddp.py", f"output_dir={tmp_path}", *FAST, *common, nproc=1)
    log = result.stdout + result.stderr
    assert "was written by 2 ranks, this run has 1" in log
    assert "2 DP ranks had read" in log and "dealt out to 1 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 41))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0
    assert_export_reproduces_checkpoint(tmp_path, step=40)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py"])
def test_activation_recompute_trains_exactly_like_keeping_activations(tmp_path, script):
    """``model_config_overrides.recompute_layers`` on two ranks (dropout on: the recompute draws the same masks):
    the same losses and gradient norms, step by step, bit for bit."""
    common = [
        *CONVERGE,
        "num_train_steps=6",
        "logger.log_every=1",
        "dataset.num_workers=0",
        "export_final_model=false",
    ]
    plain = train(script, tmp_path / "plain", *common, nproc=2)
    recomputed = train(script, tmp_path / "recompute", *common, "+model_config_overrides.recompute_layers=2", nproc=2)
    assert [m["loss"] for m in recomputed] == [m["loss"] for m in plain]
    assert [m["grad_norm"] for m in recomputed] == [m["grad_norm"] for m in plain]
    assert plain[-1]["loss"] != plain[0]["loss"]


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py"])
def test_grad_accumulation_equals_one_larger_batch(tmp_path, script):
    """grad_acc_steps=2 x 2 cells per rank == 1 x 4 cells, on 2 ranks: the same per-step losses and final weights
    (each micro-batch is weighted by its share of the step's masked genes)."""
    common = [
        *CONVERGE,
        "num_train_steps=3",
        "logger.log_every=1",
        "dataset.input_format=bshd",
        "dataset.num_workers=0",
        "adamw_kwargs.eps=1e-3",  # Adam divides by sqrt(v) + eps: keep float noise in tiny gradients from flipping signs
        "checkpoint.save_final=false",
        # Dropout draws depend on how the cells are split into micro-batches; turn it off to compare the arithmetic.
        "++model_config_overrides.hidden_dropout_prob=0.0",
        "++model_config_overrides.attention_probs_dropout_prob=0.0",
    ]
    train(script, tmp_path / "acc", *common, "dataset.micro_batch_size=2", "grad_acc_steps=2", nproc=2)
    train(script, tmp_path / "big", *common, "dataset.micro_batch_size=4", "grad_acc_steps=1", nproc=2)
    assert_same_as_one_larger_batch(tmp_path / "acc", tmp_path / "big")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_key=1"], "error: no_such_key is not a config key"),
        (["dataset.micro_batchsize=4"], "did you mean dataset.micro_batch_size?"),
        (["--config-name", "defaults"], "error: model_tag has no value ('???' in the config)"),
    ],
)
def test_bad_config_fails_clearly(tmp_path, monkeypatch, capsys, args, message):
    """Runs the real entrypoint as __main__, in-process (a subprocess would spend its time importing torch)."""
    script = str(RECIPE_DIR / "train_ddp.py")
    monkeypatch.setattr(sys, "argv", [script, f"output_dir={tmp_path}", *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code != 0
    captured = capsys.readouterr()
    assert message in captured.err + captured.out
