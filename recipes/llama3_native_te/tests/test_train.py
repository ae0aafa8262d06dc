"""End-to-end runs of the training scripts on CPU, launched the way a user launches them.

The tiny Llama (2 layers, hidden 128) trains on the shipped synthetic DNA and validates on held-out sequences of the
same chain (``data/sanity_dna_valid.fasta``). References are independent of the code under test: the training and
validation losses must fall below ln 4 ~ 1.39 nats (independent bases; lower needs context), gradient accumulation
must equal one larger batch, an interrupted run must match an uninterrupted one, and the export must give the logits
of the weights the checkpoint holds.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from compensated_adamw import join_master
from dataset import held_out_batches, read_sequences
from grad_accumulation import count_targets
from launch import RECIPE_DIR, assert_logs_read_well_off_a_terminal, run_script
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


FAST = [
    "dataset.max_seq_length=128",
    "dataset.window_overlap=0",
    "adamw_kwargs.lr=5e-3",
    "lr_scheduler_kwargs.num_decay_steps=70",
    "logger.log_every=10",
]
LOSS_THRESHOLD = 1.0  # ln 4 = 1.386 for independent bases; the chain's entropy rate is ~0.475


def train(script: str, output_dir: Path, *overrides: str, nproc: int | None = None) -> list[dict]:
    result = run_script(script, f"output_dir={output_dir}", *FAST, *overrides, nproc=nproc)
    assert_logs_read_well_off_a_terminal(result)
    return read_metrics(output_dir)


def read_metrics(output_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (output_dir / name).read_text().splitlines()]


def assert_validation_learns(output_dir: Path, steps: list[int]) -> list[dict]:
    """validation.jsonl holds the expected steps, its loss falls below the independent-bases bound."""
    validation = read_metrics(output_dir, "validation.jsonl")
    assert [v["step"] for v in validation] == steps, validation
    assert validation[-1]["val_loss"] < min(LOSS_THRESHOLD, validation[0]["val_loss"]), validation
    assert validation[-1]["val_perplexity"] == pytest.approx(np.exp(validation[-1]["val_loss"]))
    return validation


def exported_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "final_model" / "model.safetensors")


def test_ddp_one_process_learns_validates_and_export_reloads(tmp_path):
    metrics = train("train_ddp.py", tmp_path, "num_train_steps=80", "validation.every_n_steps=40")
    assert metrics[0]["loss"] > 3.0  # ln(256) ~ 5.5 at random init
    assert metrics[-1]["step"] == 80 and metrics[-1]["loss"] < LOSS_THRESHOLD, metrics
    assert_validation_learns(tmp_path, [40, 80])

    # The export, loaded the way a user does, gives the logits of the weights the checkpoint holds.
    export_dir = tmp_path / "final_model"
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    exported = AutoModelForCausalLM.from_pretrained(export_dir, config=config, trust_remote_code=True).eval()
    reference = NVLlamaForCausalLM(NVLlamaConfig.from_pretrained(export_dir, backend="torch"))
    reference.load_state_dict(torch.load(tmp_path / "checkpoints/step_80/train_state.pt", weights_only=True)["model"])
    reference.eval()
    input_ids = torch.tensor([[1, *b"ACGTTGCAACGTAAGG"]])
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
        torch.testing.assert_close(exported(input_ids).logits, reference(input_ids).logits, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py"])
def test_two_processes_learn_and_validate(tmp_path, script):
    """The held-out file plus one short sequence: rank 0 gets one batch more than rank 1, which repeats one with weight
    0 (FSDP2 gathers weights in every forward, so both must run as many); together they score every window once."""
    valid = tmp_path / "valid.fasta"
    extra = read_sequences(str(RECIPE_DIR / "data/sanity_dna_valid.fasta"))[0][:100]
    valid.write_text((RECIPE_DIR / "data/sanity_dna_valid.fasta").read_text() + f">extra\n{extra}\n")
    data_cfg = {"max_seq_length": 128, "window_overlap": 0, "token_budget": 1024}  # FAST on top of L0_sanity
    tokenizer = AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer")
    rank_batches = [len(list(held_out_batches(str(valid), data_cfg, tokenizer, r, 2).read())) for r in (0, 1)]
    assert rank_batches[0] == rank_batches[1] + 1
    scored = sum(count_targets(b, causal_lm=True) for b in held_out_batches(str(valid), data_cfg, tokenizer).read())

    overrides = ["num_train_steps=80", f"validation.path={valid}", "validation.every_n_steps=40"]
    metrics = train(script, tmp_path, *overrides, "export_final_model=false", nproc=2)
    assert metrics[-1]["step"] == 80 and metrics[-1]["loss"] < LOSS_THRESHOLD, metrics
    assert [v["val_tokens"] for v in assert_validation_learns(tmp_path, [40, 80])] == [scored, scored]


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py"])
def test_grad_accumulation_equals_one_larger_batch(tmp_path, script):
    """2 micro-batches of 2 windows per rank == 1 micro-batch of 4, with windows of different lengths and N runs, so
    the micro-batches hold different numbers of scored tokens (a plain mean of micro-batch means would differ)."""
    rng = np.random.default_rng(7)
    data = tmp_path / "uneven.jsonl"
    with data.open("w") as fh:
        for length in rng.integers(20, 120, size=16):
            bases = rng.choice(list("ACGTN"), size=length, p=[0.2, 0.2, 0.2, 0.2, 0.2])
            fh.write(json.dumps({"sequence": "".join(bases)}) + "\n")
    common = [
        f"dataset.path={data}",
        "dataset.input_format=bshd",
        "num_train_steps=2",
        "adamw_kwargs.eps=1e-3",  # Adam divides by sqrt(v) + eps: keep float noise in tiny gradients from flipping signs
        "checkpoint.save_final=false",
    ]
    train(script, tmp_path / "acc", *common, "dataset.micro_batch_size=2", "grad_acc_steps=2", nproc=2)
    train(script, tmp_path / "big", *common, "dataset.micro_batch_size=4", "grad_acc_steps=1", nproc=2)
    accumulated, single = exported_weights(tmp_path / "acc"), exported_weights(tmp_path / "big")
    initial = NVLlamaForCausalLM(NVLlamaConfig.from_pretrained("model_configs/llama3-tiny-nucleotide")).state_dict()
    for key, value in single.items():
        torch.testing.assert_close(accumulated[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(single[k], initial[k]) for k in single)  # the step did change the weights
    if script == "train_fsdp2.py":  # weights kept gathered between micro-batches: the same step, bit for bit
        kept = ["fsdp.reshard_after_forward=false", "fsdp.reshard_after_backward=false"]
        train(script, tmp_path / "kept", *common, "dataset.micro_batch_size=2", "grad_acc_steps=2", *kept, nproc=2)
        for key, value in exported_weights(tmp_path / "kept").items():
            torch.testing.assert_close(value, accumulated[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    ("script", "nproc", "extra"),
    [
        ("train_ddp.py", None, []),
        ("train_fsdp2.py", 2, []),
        # fp32 masters held in the optimizer: the low bits come back from the checkpoint, not from the new init
        ("train_ddp.py", None, ["mixed_precision.on_cpu=true", "mixed_precision.masters_in_optimizer=true"]),
    ],
    ids=["ddp", "fsdp2", "ddp-masters-in-optimizer"],
)
def test_stop_and_go_matches_an_uninterrupted_run(tmp_path, script, nproc, extra):
    """Packed batches split windows over batch boundaries: the resumed run must start mid-window, exactly."""
    overrides = ["dataset.token_budget=500", "lr_scheduler_kwargs.num_warmup_steps=2", "logger.log_every=1", *extra]
    overrides += ["validation.every_n_steps=4", "validation.max_batches=2"]
    straight = train(script, tmp_path / "straight", "num_train_steps=8", *overrides, nproc=nproc)
    train(script, tmp_path / "resumed", "num_train_steps=4", "export_final_model=false", *overrides, nproc=nproc)
    resumed = train(script, tmp_path / "resumed", "num_train_steps=8", *overrides, nproc=nproc)
    assert [m["step"] for m in resumed] == list(range(1, 9))  # metrics.jsonl is appended to
    assert [m["loss"] for m in resumed[4:]] == pytest.approx([m["loss"] for m in straight[4:]], rel=1e-6, abs=1e-7)
    validation = [read_metrics(tmp_path / run, "validation.jsonl") for run in ("straight", "resumed")]
    assert [v["step"] for v in validation[1]] == [v["step"] for v in validation[0]] == [4, 8]
    assert [v["val_loss"] for v in validation[1]] == pytest.approx([v["val_loss"] for v in validation[0]], rel=1e-6)
    for key, value in exported_weights(tmp_path / "straight").items():
        torch.testing.assert_close(exported_weights(tmp_path / "resumed")[key], value, rtol=1e-6, atol=1e-7)


def test_resume_on_one_rank_continues_a_two_rank_run(tmp_path):
    """FSDP2, 40 steps on 2 processes, then the same command on 1 process: DCP re-shards model and optimizer, the data
    goes on with the windows of the epoch that neither rank had started, and the run learns on to step 80. (That each
    window is read once is tests/test_window_order.py's.)"""
    overrides = ["logger.log_every=1", "export_final_model=false"]
    train("train_fsdp2.py", tmp_path, "num_train_steps=40", *overrides, nproc=2)
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path}", *FAST, "num_train_steps=80", *overrides, nproc=1)
    log = result.stdout + result.stderr
    assert "was written by 2 ranks, this run has 1" in log
    assert "2 DP ranks had started" in log and "dealt out to 1 DP rank(s)" in log
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 81))
    assert metrics[-1]["loss"] < LOSS_THRESHOLD, metrics[-5:]


def test_unknown_config_key_fails(tmp_path):
    result = run_script("train_ddp.py", f"output_dir={tmp_path}", "dataset.sequence_colum=x", expect_failure=True)
    assert "sequence_colum" in result.stderr


def test_missing_required_value_fails_by_name(tmp_path):
    result = run_script("train_ddp.py", "--config-name", "L1_1B_perf", f"output_dir={tmp_path}", expect_failure=True)
    assert "dataset.path" in result.stderr


def test_context_parallel_run_equals_a_one_process_run(tmp_path):
    """cp_size=2 on 2 processes (torch backend, dp=1) trains on the same windows as train_fsdp2.py in one process, and
    context parallelism must not change the arithmetic: per-step losses, gradient norms, the validation loss (full
    context-parallel batches, each rank scoring its share) and the final weights agree. Weights are built before
    sharding (no meta device) so both runs start from the same initialisation."""
    common = [
        "num_train_steps=6",
        "logger.log_every=1",
        "lr_scheduler_kwargs.num_warmup_steps=2",
        "validation.every_n_steps=3",
        "fsdp.use_meta_device=false",
        "dataset.max_seq_length=200",
        "dataset.token_budget=700",  # windows split over batches, pieces of uneven length (CP pads each to 4k)
    ]
    single = train("train_fsdp2.py", tmp_path / "single", "+model_config_overrides.backend=torch", *common)
    cp = train("train_cp.py", tmp_path / "cp", "cp_size=2", *common, nproc=2)  # its default config: L0_sanity_cp
    assert [m["loss"] for m in cp] == pytest.approx([m["loss"] for m in single], rel=1e-4)
    assert [m["grad_norm"] for m in cp] == pytest.approx([m["grad_norm"] for m in single], rel=1e-3)
    single_val, cp_val = (read_metrics(tmp_path / run, "validation.jsonl") for run in ("single", "cp"))
    assert [(v["step"], v["val_tokens"]) for v in cp_val] == [(v["step"], v["val_tokens"]) for v in single_val]
    assert [v["val_loss"] for v in cp_val] == pytest.approx([v["val_loss"] for v in single_val], rel=1e-4)
    assert [v["step"] for v in cp_val] == [3, 6] and cp_val[1]["val_loss"] < cp_val[0]["val_loss"]
    for key, value in exported_weights(tmp_path / "single").items():
        torch.testing.assert_close(exported_weights(tmp_path / "cp")[key], value, rtol=1e-3, atol=1e-5)


def test_context_parallel_learns_and_resumes_exactly(tmp_path):
    """L0_sanity_cp on 2 CPU processes: the training and validation losses fall below the independent-bases bound,
    and a run stopped at step 4 and resumed matches the uninterrupted one."""
    overrides = ["dataset.token_budget=512", "logger.log_every=1"]
    straight = train("train_cp.py", tmp_path / "straight", "num_train_steps=60", *overrides, nproc=2)
    assert straight[-1]["loss"] < LOSS_THRESHOLD, straight[-1]
    validation = read_metrics(tmp_path / "straight", "validation.jsonl")  # every 50 steps, as L0_sanity says
    assert [v["step"] for v in validation] == [50] and validation[0]["val_loss"] < LOSS_THRESHOLD, validation
    train(
        "train_cp.py",
        tmp_path / "resumed",
        "num_train_steps=4",
        "export_final_model=false",
        *overrides,
        nproc=2,
    )
    resumed = train("train_cp.py", tmp_path / "resumed", "num_train_steps=8", *overrides, nproc=2)
    assert [m["loss"] for m in resumed[4:8]] == pytest.approx([m["loss"] for m in straight[4:8]], rel=1e-6, abs=1e-7)


def test_train_cp_refuses_cp_size_one(tmp_path):
    result = run_script("train_cp.py", f"output_dir={tmp_path}", "cp_size=1", expect_failure=True)
    assert "cp_size >= 2" in result.stderr


def test_l0_convergence_overfits(tmp_path):
    """The L0_convergence config as shipped (~20 s on 2 cores): random bases memorised, loss near zero."""
    run_script("train_ddp.py", "--config-name", "L0_convergence", f"output_dir={tmp_path}", timeout=900)
    assert read_metrics(tmp_path)[-1]["loss"] < 0.05


def test_fp32_masters_held_in_the_optimizer_train_as_fp32_weights_do(tmp_path):
    """``mixed_precision.masters_in_optimizer``: bf16 weights plus their low bits in CompensatedAdamW, float32 moments.

    On CPU with bf16 compute (``on_cpu``), against the fp32 weights it replaces, from the same init and data at a
    learning rate where the runs stay on one trajectory: the losses agree to 0.01 at every logged step (0.0023 at
    most when written; the GEMMs see the same bf16 weights, the weight gradients are rounded to bf16 once in both, the
    norms' and the embedding's weights are bf16 here, as FSDP2's compute copies are). The export holds the float32
    masters: the checkpoint's bf16 weights joined with its optimizer's low bits, bit for bit. grad_acc_steps > 1 is
    refused by name; train_fsdp2.py, which keeps fp32 masters its own way, runs with the setting switched off."""
    common = [
        *[override for override in FAST if not override.startswith("adamw_kwargs.lr")],
        "adamw_kwargs.lr=1e-3",
        "num_train_steps=40",
        "logger.log_every=5",
        "mixed_precision.on_cpu=true",
        "validation.path=null",
    ]
    runs = {}
    for name, masters_in_optimizer in [("fp32", "false"), ("split", "true")]:
        override = f"mixed_precision.masters_in_optimizer={masters_in_optimizer}"
        run_script("train_ddp.py", f"output_dir={tmp_path / name}", *common, override)
        runs[name] = read_metrics(tmp_path / name)
    assert [m["step"] for m in runs["split"]] == [m["step"] for m in runs["fp32"]] == list(range(5, 41, 5))
    for fp32, split in zip(runs["fp32"], runs["split"]):
        assert abs(fp32["loss"] - split["loss"]) < 0.01, runs
    assert runs["split"][-1]["loss"] < runs["split"][0]["loss"] - 2.0, runs["split"]  # it learns

    state = torch.load(tmp_path / "split/checkpoints/step_40/train_state.pt", weights_only=True)
    config = NVLlamaConfig.from_pretrained(tmp_path / "split/final_model")
    exported = exported_weights(tmp_path / "split")
    for index, (name, _) in enumerate(NVLlamaForCausalLM(config).named_parameters()):  # the optimizer's order
        low = state["optimizer"]["state"][index]["compensation"]
        assert exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], join_master(state["model"][name], low)), name

    on = "mixed_precision.masters_in_optimizer=true"
    args = [*common, on]
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path / 'refused'}", *args, "grad_acc_steps=2", expect_failure=True
    )
    assert "needs grad_acc_steps=1" in result.stderr, result.stderr[-2000:]
    result = run_script("train_fsdp2.py", f"output_dir={tmp_path / 'fsdp2'}", *args, "num_train_steps=2")
    assert "masters_in_optimizer is for train_ddp.py" in result.stdout + result.stderr
