"""End-to-end runs of the training scripts on CPU, launched the way a user launches them.

A tiny ESM-2 (2 layers, hidden 64) trains on the shipped synthetic protein families. References are independent of
the code under test: the loss must fall below the amino-acid background entropy (~2.9 nats, which needs context),
an interrupted run must match an uninterrupted one bit for bit, and the export must reproduce the weights that the
checkpoint holds.
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
from compensated_adamw import split_master
from dataset import create_dataloader
from grad_accumulation import count_targets
from launch import RECIPE_DIR, assert_logs_read_well_off_a_terminal, run_script
from model_families import family_of
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer
from validation import HeldOutBatches, Validator
from validation_data import held_out_batches


TINY_MODEL = (
    "+model_config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 256, num_attention_heads: 4}"
)
FAST_BATCHING = {"max_seq_length": 128, "micro_batch_size": 16, "token_budget": 2048}
FAST = [f"dataset.{key}={value}" for key, value in FAST_BATCHING.items()]
# Converges within 80 steps at this learning rate (about 3 s of training on one core).
CONVERGE = [
    "num_train_steps=80",
    "adamw_kwargs.lr=3e-3",
    "lr_scheduler_kwargs.num_warmup_steps=10",
    "lr_scheduler_kwargs.num_decay_steps=70",
    "logger.log_every=10",
]
# Below ~2.9 nats (the residue background entropy) a model must be using context: see scripts/make_sanity_dataset.py.
LOSS_THRESHOLD = 2.85
# Held-out loss at steps 40 and 80 on the shipped validation file (200 sequences; a few forward passes per rank).
VALIDATE = ["validation.path=data/sanity_proteins_val.parquet", "validation.every_n_steps=40"]


def train(script: str, output_dir: Path, *overrides: str, nproc: int | None = None) -> list[dict]:
    result = run_script(script, f"output_dir={output_dir}", TINY_MODEL, *FAST, *overrides, nproc=nproc)
    assert_logs_read_well_off_a_terminal(result)
    return read_metrics(output_dir)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def load_export(output_dir: Path):
    """The exported model on CPU with the torch backend, also on a GPU machine (where "auto" would pick TE)."""
    export_dir = output_dir / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    return AutoModelForMaskedLM.from_pretrained(export_dir, config=config, trust_remote_code=True)


def checkpoint_weights(step_dir: Path, model_class: type, config) -> torch.nn.Module:
    """The weights a training checkpoint holds, read by plain torch/DCP code rather than the export path."""
    model = model_class(config)
    if (step_dir / "train_state.pt").exists():  # DDP
        model.load_state_dict(torch.load(step_dir / "train_state.pt", weights_only=True)["model"])
    else:  # FSDP2 / Megatron-FSDP: a DCP directory, read without a process group
        # TE's FP8 bookkeeping (_extra_state) is not part of the weights; Megatron-FSDP keeps its wrapper's prefix.
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


def assert_export_reproduces_checkpoint(output_dir: Path, step: int) -> None:
    """Both models on CPU with the torch backend."""
    export_dir = output_dir / "final_model"
    exported = load_export(output_dir).eval()
    assert exported.backend == "torch"
    family = family_of(str(export_dir))  # ESM-2 or AMPLIFY
    config = family.load_config(str(export_dir), backend="torch")
    reference = checkpoint_weights(output_dir / "checkpoints" / f"step_{step}", family.model_class, config)
    # A run with bf16 weights exports bf16 tensors (and its config builds some of the reference's in bf16): the
    # values are what must match, so both models compute in float32.
    exported, reference = exported.float(), reference.float()
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    sequences = pq.read_table(RECIPE_DIR / "data" / "sanity_proteins_val.parquet").column("sequence").to_pylist()
    batch = tokenizer([s[:100] for s in sequences[:4]], return_tensors="pt", padding=True)
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


def assert_validation_is_the_exports_held_out_loss(
    output_dir: Path,
    steps: list[int],
    batching: dict,
    input_format: str,
    cp_size: int = 1,
    rel: float = 1e-4,
    falls: bool = True,
    tokenizer_dir: str = "tokenizer",
) -> None:
    """validation.jsonl holds ``steps``, the loss is below ln(33) ~ 3.5 (the start) and, with ``falls``, lower at the
    last step than at the first; and its last value is what one process computes on CPU for the exported model on the
    same held-out batches (``batching``: the run's dataset settings; the seed is 42), where the run's validation was
    split over ranks or context-parallel ranks, or ran on TE. ``tokenizer_dir``: the model family's tokenizer."""
    records = [json.loads(line) for line in (output_dir / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == steps
    assert max(r["val_loss"] for r in records) < 3.3, records
    assert not falls or records[-1]["val_loss"] < records[0]["val_loss"], records
    data_cfg = {"path": "unused", "input_format": input_format, **batching}
    tokenizer = AutoTokenizer.from_pretrained(RECIPE_DIR / tokenizer_dir)

    def run_batches_whole(path: str) -> HeldOutBatches:
        """The run's (CP-padded) batches, run whole: without the padded boundaries, which only CP accepts (they
        equal the real ones: CP padding counts as part of its sequence)."""
        data = held_out_batches(path, data_cfg, tokenizer, seed=42, cp_size=cp_size)
        batches = [{k: v for k, v in b.items() if not k.endswith("_padded")} for b in data.read()]
        return HeldOutBatches(lambda: batches, data.placeholder, causal_lm=False)

    held_out = str(RECIPE_DIR / "data" / "sanity_proteins_val.parquet")
    one_process = Validator(
        OmegaConf.create({"path": held_out, "every_n_steps": 1, "max_batches": None}),
        run_batches_whole,
        dp_rank=0,
        device=torch.device("cpu"),
        output_dir=output_dir / "one_process",
    ).run(load_export(output_dir), step=steps[-1])
    assert one_process["val_tokens"] == records[-1]["val_tokens"]
    assert one_process["val_loss"] == pytest.approx(records[-1]["val_loss"], rel=rel)


def assert_same_training_to_float32_rounding(accumulated_dir: Path, single_dir: Path) -> None:
    """Two runs that compute the same steps in another order (k micro-batches a step and one k times larger batch;
    two strategies on one GPU): the same losses, gradient norms and exported weights to float32 rounding, over steps
    that did change the weights."""
    accumulated, single = read_metrics(accumulated_dir), read_metrics(single_dir)
    assert [m["loss"] for m in accumulated] == pytest.approx([m["loss"] for m in single], rel=1e-5)
    assert [m["grad_norm"] for m in accumulated] == pytest.approx([m["grad_norm"] for m in single], rel=1e-4)
    assert single[-1]["loss"] != single[0]["loss"]  # the steps did change the weights
    expected = load_export(single_dir).state_dict()
    for key, value in load_export(accumulated_dir).state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)


def assert_converged(metrics: list[dict], steps: int, initial_loss_above: float = 3.0) -> None:
    assert metrics[0]["loss"] > initial_loss_above  # ESM-2 starts near ln(33) = 3.5
    assert metrics[-1]["step"] == steps
    final_loss = sum(m["loss"] for m in metrics if m["step"] > steps - 20) / len(
        [m for m in metrics if m["step"] > steps - 20]
    )
    assert final_loss < LOSS_THRESHOLD, [round(m["loss"], 3) for m in metrics]


# The two 2-process combinations not listed here (DDP/BSHD, FSDP2/THD) converge inside the stop-and-go test below. On
# one process each strategy runs one input format: the format is the collator's and the model's, not the strategy's.
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
    """... and scores the held-out file: at L0_sanity's step 75, or on two processes every 40 steps (split over the
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
        assert [json.loads(line)["step"] for line in (tmp_path / "validation.jsonl").read_text().splitlines()] == [75]


def test_context_parallel_on_two_cpu_processes_converges_and_exports(tmp_path):
    """train_cp.py with cp_size=2 (torch backend: all-gathered attention) learns and exports a loadable model.
    The model tests prove CP numerically equal to one process; this proves the recipe's plumbing, validation included
    (each CP rank runs its share of every held-out batch)."""
    run_script("train_cp.py", f"output_dir={tmp_path}", TINY_MODEL, *FAST, *CONVERGE, *VALIDATE, nproc=2)
    metrics = read_metrics(tmp_path)
    assert_converged(metrics, steps=80)
    assert_export_reproduces_checkpoint(tmp_path, step=80)
    assert_validation_is_the_exports_held_out_loss(tmp_path, [40, 80], FAST_BATCHING, "thd", cp_size=2)


def restart_with_recompute(script: str, run_dir: Path, step: int, restart_dir: Path, *overrides: str) -> list[dict]:
    """Run ``script`` in ``restart_dir`` holding nothing but ``run_dir``'s checkpoint of ``step`` (what a preempted job
    finds on its next launch when its last periodic save was at ``step``), with both layers of the tiny model
    recomputing their activations in backward; return the restart's metrics."""
    name = f"step_{step}"
    shutil.copytree(run_dir / "checkpoints" / name, restart_dir / "checkpoints" / name)
    overrides = (*overrides, "+model_config_overrides.recompute_layers=2")
    result = run_script(script, f"output_dir={restart_dir}", TINY_MODEL, *FAST, *overrides, nproc=2)
    assert_logs_read_well_off_a_terminal(result)
    assert "activations of 2 of 2 layers recomputed in backward" in result.stdout + result.stderr
    return read_metrics(restart_dir)


@pytest.mark.parametrize(
    ("script", "extra", "steps"),
    [
        # DDP with gradient accumulation (no_sync on the first micro-batch) and a dataloader worker process.
        ("train_ddp.py", ["dataset.input_format=bshd", "grad_acc_steps=2", "dataset.num_workers=1"], 80),
        # FSDP2 with packed sequences and asynchronous checkpoints (the step-40 save is written while training goes on).
        ("train_fsdp2.py", ["dataset.input_format=thd", "checkpoint.async_save=true", "dataset.num_workers=0"], 80),
        # bf16 weights (CompensatedAdamW): its compensation tensors are checkpointed and restored with the moments.
        (
            "train_fsdp2.py",
            ["mixed_precision.on_cpu=true", "mixed_precision.fp32_master_weights=false", "dataset.num_workers=0"],
            80,
        ),
        # Context parallelism (each sequence split over the 2 ranks, one DP rank) with gradient accumulation. It learns
        # in test_context_parallel_on_two_cpu_processes_converges_and_exports: here 20 steps (the slowest on CPU).
        ("train_cp.py", ["cp_size=2", "dataset.input_format=thd", "grad_acc_steps=2", "dataset.num_workers=0"], 20),
    ],
    ids=["ddp", "fsdp2", "fsdp2-bf16-weights", "cp"],
)
def test_stop_and_go_matches_uninterrupted_run(tmp_path, script, extra, steps):
    """``steps`` in one go, saving half way (and at the end, a periodic save that save_final must not repeat), vs a
    restart from that half-way checkpoint: identical losses, gradient norms and final weights; 80-step runs learn.

    The restart also recomputes both layers' activations in backward (``recompute_layers``), which must not change a
    bit either. So this pins activation recompute under DDP, FSDP2 (the recompute re-entering the sharded layer in
    backward) and context parallelism (torch backend: all-gathered attention) without runs of its own. Should the
    restart's first step differ, the same restart without recompute tells which of the two broke.

    The DDP restart reads its data without the worker process the first run had: a loader state loads only into a
    loader with as many workers, so the position comes from the batch sampler (checkpoint.py), and must be exact."""
    half = steps // 2
    common = [*CONVERGE, "logger.log_every=1", f"num_train_steps={steps}", f"checkpoint.save_every={half}", *extra]
    full = train(script, tmp_path / "full", *common, nproc=2)
    other_workers = ["dataset.num_workers=0"] if script == "train_ddp.py" else []
    resumed = restart_with_recompute(script, tmp_path / "full", half, tmp_path / "restarted", *common, *other_workers)

    if steps == 80:
        assert_converged(full, steps=80)
    assert_export_reproduces_checkpoint(tmp_path / "full", step=steps)
    assert [m["step"] for m in resumed] == list(range(half + 1, steps + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[half:]]  # bit-identical, not just close
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in full[half:]]
    full_model = load_export(tmp_path / "full")
    resumed_state = load_export(tmp_path / "restarted").state_dict()
    for name, value in full_model.state_dict().items():
        torch.testing.assert_close(resumed_state[name], value, rtol=0, atol=0, msg=name)


def test_resume_on_one_rank_continues_a_two_rank_run(tmp_path):
    """FSDP2 with packed sequences: 40 steps on 2 processes, then the same command on 1 process resumes them (DCP
    re-shards model and optimizer), finishes the epoch's unread sequences and converges; the export holds the final
    checkpoint's weights. (That the rows continue exactly is tests/test_checkpoint.py's and the sampler's tests'.)"""
    common = [*CONVERGE, "logger.log_every=1", "dataset.input_format=thd", "dataset.num_workers=0"]
    train("train_fsdp2.py", tmp_path, *common, "num_train_steps=40", nproc=2)
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path}", TINY_MODEL, *FAST, *common, nproc=1)
    log = result.stdout + result.stderr
    assert "was written by 2 ranks, this run has 1" in log
    assert "2 DP ranks had read" in log and "dealt out to 1 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 81))
    assert_converged(metrics, steps=80)
    assert_export_reproduces_checkpoint(tmp_path, step=80)


def test_micro_batches_of_b_hold_the_samples_and_masks_of_one_batch_of_2b():
    """The premise of the next test: the sampler cuts one order into batches, and masking depends only on (seed,
    epoch, sample index), so two micro-batches of 2 are one batch of 4 split in two; and they score different numbers
    of tokens, so weighting them equally (dividing by grad_acc_steps) would not give the larger batch's gradient."""
    tokenizer = AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer")
    data = {"path": str(RECIPE_DIR / "data" / "sanity_proteins.parquet"), "max_seq_length": 128, "num_workers": 0}
    small = iter(create_dataloader({**data, "micro_batch_size": 2}, tokenizer, dp_rank=1, dp_world_size=2, seed=42))
    large = iter(create_dataloader({**data, "micro_batch_size": 4}, tokenizer, dp_rank=1, dp_world_size=2, seed=42))
    padding = {"input_ids": tokenizer.pad_token_id, "labels": -100, "attention_mask": 0}
    unequal = 0
    for _ in range(3):
        first, second, both = next(small), next(small), next(large)
        for key, value in padding.items():  # each batch is padded to its own longest sequence
            length = both[key].shape[1]
            halves = [
                torch.nn.functional.pad(b[key], (0, length - b[key].shape[1]), value=value) for b in (first, second)
            ]
            assert torch.equal(torch.cat(halves), both[key]), key
        unequal += count_targets(first, causal_lm=False) != count_targets(second, causal_lm=False)
    assert unequal


# Context parallelism takes packed (THD) batches, cut by a token budget. Sequences cut to 32 tokens (every one of the
# sanity set is longer) make a budget of 64 tokens two sequences and one of 128 four, as micro_batch_size does.
SAME_LENGTH_THD = ["cp_size=2", "dataset.input_format=thd", "dataset.max_seq_length=32"]


@pytest.mark.parametrize(
    ("script", "extra", "small", "large"),
    [
        ("train_ddp.py", [], "dataset.micro_batch_size=2", "dataset.micro_batch_size=4"),
        ("train_fsdp2.py", [], "dataset.micro_batch_size=2", "dataset.micro_batch_size=4"),
        ("train_cp.py", SAME_LENGTH_THD, "dataset.token_budget=64", "dataset.token_budget=128"),
    ],
    ids=["ddp", "fsdp2", "cp"],
)
def test_grad_accumulation_equals_one_larger_batch(tmp_path, script, extra, small, large):
    """grad_acc_steps=2 x 2 sequences per rank == 1 x 4 sequences, on 2 ranks (with CP: one DP rank, each sequence
    split over both): the same per-step losses and final weights. Equal in exact arithmetic because each micro-batch
    is weighted by its share of the step's masked tokens (see the premise above); what differs is float rounding (BSHD
    padding lengths, summation order)."""
    common = [
        *CONVERGE,
        "num_train_steps=3",
        "logger.log_every=1",
        "dataset.input_format=bshd",
        "dataset.num_workers=0",
        "adamw_kwargs.eps=1e-3",  # Adam divides by sqrt(v) + eps: keep float noise in tiny gradients from flipping signs
        "checkpoint.save_final=false",
        *extra,
    ]
    train(script, tmp_path / "acc", *common, small, "grad_acc_steps=2", nproc=2)
    train(script, tmp_path / "big", *common, large, "grad_acc_steps=1", nproc=2)
    assert_same_training_to_float32_rounding(tmp_path / "acc", tmp_path / "big")


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py"])
def test_two_ranks_of_one_sequence_equal_one_rank_of_two(tmp_path, script):
    """The same step split over ranks instead of micro-batches: 2 ranks x 1 sequence == 1 rank x 2 micro-batches of
    1 (rank r reads the r-th sequence of each pair, the one rank both, with the same masks). Equal because every
    micro-batch weighs its masked tokens over the whole step's, on all ranks (grad_accumulation.step_token_weights):
    with each rank's own mean, a token on the rank that drew fewer masked tokens would weigh more, and they differ."""
    common = [
        *CONVERGE,
        "num_train_steps=3",
        "logger.log_every=1",
        "dataset.input_format=bshd",
        "dataset.micro_batch_size=1",
        "dataset.num_workers=0",
        "adamw_kwargs.eps=1e-3",
        "checkpoint.save_final=false",
    ]
    train(script, tmp_path / "ranks", *common, "grad_acc_steps=1", nproc=2)
    train(script, tmp_path / "micro_batches", *common, "grad_acc_steps=2", nproc=1)
    assert_same_training_to_float32_rounding(tmp_path / "ranks", tmp_path / "micro_batches")


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


def test_fp32_masters_held_in_the_optimizer_train_as_fp32_weights_do_on_two_ranks(tmp_path):
    """``mixed_precision.masters_in_optimizer`` (bf16 weights plus their low bits in CompensatedAdamW, float32
    moments; DDP averages the bf16 gradients in float32) against the fp32 weights it replaces, on two CPU processes
    with bf16 compute, same init and data: the losses agree to 0.02 at every logged step (0.0052 at most when
    written), and the export holds float32 weights that round to the checkpoint's bf16 ones (split as the optimizer
    splits them) with their low bits in use.
    grad_acc_steps > 1 is refused by name; train_fsdp2.py, which keeps fp32 masters its own way, runs with
    the setting switched off."""
    common = [*CONVERGE, "num_train_steps=40", "logger.log_every=5", "mixed_precision.on_cpu=true"]
    runs = {}
    for name, masters_in_optimizer in [("fp32", "false"), ("split", "true")]:
        override = f"mixed_precision.masters_in_optimizer={masters_in_optimizer}"
        runs[name] = train("train_ddp.py", tmp_path / name, *common, override, nproc=2)
    assert [m["step"] for m in runs["split"]] == [m["step"] for m in runs["fp32"]] == list(range(5, 41, 5))
    for fp32, split in zip(runs["fp32"], runs["split"]):
        assert abs(fp32["loss"] - split["loss"]) < 0.02, runs
    assert runs["split"][-1]["loss"] < runs["split"][0]["loss"] - 0.2, runs["split"]  # it learns

    model_state = torch.load(tmp_path / "split/checkpoints/step_40/train_state.pt", weights_only=True)["model"]
    exported = load_file(tmp_path / "split/final_model/model.safetensors")
    for name, weight in exported.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(split_master(weight)[0], model_state[name]), name
    assert any(not torch.equal(weight, weight.bfloat16().float()) for weight in exported.values())

    on = "mixed_precision.masters_in_optimizer=true"
    args = [TINY_MODEL, *FAST, *common, on]
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path / 'refused'}", *args, "grad_acc_steps=2", expect_failure=True
    )
    assert "needs grad_acc_steps=1" in result.stderr, result.stderr[-2000:]
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path / 'fsdp2'}", *args, "num_train_steps=2")
    assert "masters_in_optimizer is for train_ddp.py" in result.stdout + result.stderr
