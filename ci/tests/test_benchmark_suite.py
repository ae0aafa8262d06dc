"""ci/benchmark_suite.py: the shipped suite composes, bad suites fail before any run, verdicts, and a tiny CPU suite."""

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml


REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "ci"))
import benchmark  # noqa: E402
import benchmark_suite  # noqa: E402


SHIPPED = REPO_ROOT / "ci" / "benchmark_suites" / "targets_1gpu.yaml"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def write_suite(tmp_path: Path, runs: dict, defaults: dict | None = None) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"defaults": defaults or {}, "runs": runs}, sort_keys=False))
    return path


def tiny_run(**changes) -> dict:
    """One ESM-2 8M layer on CPU for 4 steps: seconds, and a real summary.json."""
    run = {
        "asks": "a tiny CPU run",
        "recipe": "recipes/esm2_native_te",
        "entrypoint": "train_ddp.py",
        "config": "L0_sanity",
        "data": "synthetic_protein.parquet",
        "overrides": ["+model_config_overrides.num_hidden_layers=1"],
        "steps": 4,
        "warmup": 2,
        "log_every": 2,
        "target": {"tokens_per_second_per_gpu": 1},
    }
    return {**run, **changes}


def test_every_shipped_run_composes_and_names_a_shared_data_file():
    runs = benchmark_suite.load_suite(SHIPPED)
    assert {"esm2_650m_bf16", "esm2_3b_fp8", "llama3_1b", "opengenome2_1b"} <= set(runs)
    # Each config composes with its overrides (a renamed key fails here, not after an hour of GPU runs before it).
    benchmark_suite.check_runs(runs, SHARED_DATA, need_data=SHARED_DATA.is_dir())
    assert runs["esm2_3b_fp8"]["target"] == {"speedup_over": {"run": "esm2_3b_bf16", "at_least": 1.35}}
    assert runs["esm2_3b_fp32_masters"]["gpu_memory_gib"] == 78 and runs["esm2_3b_fp32_masters"]["steps"] == 30
    assert runs["llama3_1b"]["steps"] == 35 and runs["llama3_1b"]["entrypoint"] == "train_fsdp2.py"


def test_a_renamed_config_key_fails_the_check(tmp_path):
    runs = {"a": tiny_run(overrides=["dataset.no_such_key=1"])}
    with pytest.raises(benchmark_suite.SuiteError, match="run 'a': config L0_sanity"):
        benchmark_suite.check_runs(benchmark_suite.load_suite(write_suite(tmp_path, runs)), tmp_path, need_data=False)
    with pytest.raises(benchmark_suite.SuiteError, match="no data file"):
        benchmark_suite.check_runs(benchmark_suite.load_suite(write_suite(tmp_path, {"a": tiny_run()})), tmp_path)


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ({"a": tiny_run(stpes=3)}, r"run 'a' has unknown key\(s\) \['stpes'\]"),
        ({"a": {k: v for k, v in tiny_run().items() if k != "data"}}, r"run 'a' lacks \['data'\]"),
        ({"a": tiny_run(target={"tokens": 5})}, "target must be one of"),
        ({"a": tiny_run(target={"mfu": -0.1})}, "mfu must be a positive number"),
        ({"a": tiny_run(target={"fits": "yes"})}, "written 'fits: true'"),
        ({"a": tiny_run(target={"speedup_over": {"run": "b", "at_least": 1.3}})}, "names 'b', not another run"),
        ({"a": tiny_run(target={"speedup_over": {"run": "a", "at_least": 1.3}})}, "names 'a', not another run"),
        ({"a": tiny_run(overrides="dataset.token_budget=1")}, "overrides must be a list of key=value strings"),
        ({"a": tiny_run(steps=0)}, "steps must be a positive integer, got 0"),
        ({"a": tiny_run(warmup="15")}, "warmup must be a non-negative integer, got '15'"),
        ({"a": tiny_run(gpu_memory_gib="78")}, "gpu_memory_gib must be a positive number of GiB"),
    ],
)
def test_a_malformed_suite_names_the_run_and_key(tmp_path, runs, message):
    with pytest.raises(benchmark_suite.SuiteError, match=message):
        benchmark_suite.load_suite(write_suite(tmp_path, runs))


def test_a_missing_or_unreadable_suite_file_is_named(tmp_path):
    with pytest.raises(benchmark_suite.SuiteError, match="no suite file"):
        benchmark_suite.load_suite(tmp_path / "nothing.yaml")
    (tmp_path / "bad.yaml").write_text("runs: [unclosed\n")
    with pytest.raises(benchmark_suite.SuiteError, match="bad.yaml is not valid YAML"):
        benchmark_suite.load_suite(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(benchmark_suite.SuiteError, match="expected a mapping with a non-empty 'runs' mapping"):
        benchmark_suite.load_suite(tmp_path / "list.yaml")


def test_unknown_defaults_and_only_names_are_refused(tmp_path):
    with pytest.raises(benchmark_suite.SuiteError, match=r"unknown key\(s\) \['step'\] in defaults"):
        benchmark_suite.load_suite(write_suite(tmp_path, {"a": tiny_run()}, defaults={"step": 3}))
    runs = benchmark_suite.load_suite(SHIPPED)
    with pytest.raises(benchmark_suite.SuiteError, match="--only names no run"):
        benchmark_suite.select(runs, "esm2_650m_bf16,esm2_650m_bf17")
    # A speed-up is reported only from one lease: its base must run too.
    with pytest.raises(benchmark_suite.SuiteError, match="add esm2_3b_bf16 to --only"):
        benchmark_suite.select(runs, "esm2_3b_fp8")
    assert list(benchmark_suite.select(runs, "esm2_3b_fp8, esm2_3b_bf16")) == ["esm2_3b_bf16", "esm2_3b_fp8"]


def test_verdicts_say_met_or_missed_and_by_how_much():
    result = {"tokens_per_second_per_gpu": 119_962.0, "mfu": 0.502, "peak_memory_gb": 72.9}
    spec = {"target": {"tokens_per_second_per_gpu": 125_000}}
    assert benchmark_suite.verdict(spec, result, None, {}) == (
        "missed by 4.0% (119,962 tokens/s against 125,000 tokens/s)"
    )
    assert benchmark_suite.verdict({"target": {"mfu": 0.45}}, result, None, {}).startswith("met by 11.6% (50.2% MFU")
    fp8 = {"target": {"speedup_over": {"run": "bf16", "at_least": 1.35}}}
    bf16 = {"tokens_per_second_per_gpu": 31_546.0}
    assert benchmark_suite.verdict(fp8, {**result, "tokens_per_second_per_gpu": 45_838.0}, None, {"bf16": bf16}) == (
        "met by 7.6% (1.453x against 1.350x)"
    )
    assert benchmark_suite.verdict(fp8, result, None, {"bf16": None}) == "not compared: bf16 failed"
    fits = {"target": {"fits": True}, "gpu_memory_gib": 78}
    assert benchmark_suite.verdict(fits, result, None, {}) == "fits (72.9 GB peak under a 78 GiB cap)"
    oom = "train_ddp.py exited with 1: out of memory (torch.OutOfMemoryError: CUDA out of memory.)"
    assert benchmark_suite.verdict(fits, None, oom, {}).startswith("does not fit under a 78 GiB cap: train_ddp.py")
    assert benchmark_suite.verdict(spec, None, oom, {}) == f"failed: {oom}"


def test_dry_run_prints_commands_that_benchmark_py_accepts(capsys):
    assert benchmark_suite.main([str(SHIPPED), "--dry-run", "--only", "esm2_3b_bf16,esm2_3b_fp32_masters"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python3 ")]
    assert len(commands) == 2
    args = [benchmark.build_parser().parse_args(shlex.split(command)[2:]) for command in commands]
    assert args[0].config == "L1_3B" and args[0].override == ["mixed_precision.fp32_master_weights=false"]
    assert args[0].output_dir == "OUT/esm2_3b_bf16" and args[0].gpu_memory_gib is None
    assert args[1].entrypoint == "train_fsdp2.py" and args[1].gpu_memory_gib == 78 and args[1].steps == 30


def test_a_tiny_cpu_suite_runs_each_run_keeps_going_after_a_failure_and_writes_verdicts(tmp_path, capsys):
    benchmark.write_synthetic_parquet("protein:64", tmp_path)
    runs = {
        "first": tiny_run(),
        # On a machine without a GPU the allocator cap cannot be set: this run fails, and the suite goes on.
        "capped": tiny_run(gpu_memory_gib=1, target={"fits": True}),
        "second": tiny_run(target={"speedup_over": {"run": "first", "at_least": 0.000001}}),
    }
    markdown = tmp_path / "benchmarks.md"
    shipped_table = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    markdown.write_text(shipped_table)
    out_dir = tmp_path / "out"
    argv = [str(write_suite(tmp_path, runs)), "--data-dir", str(tmp_path), "--out-dir", str(out_dir)]
    assert benchmark_suite.main([*argv, "--markdown", str(markdown)]) == 1  # a run failed
    assert "benchmark_suite: capped failed: " in capsys.readouterr().out

    first = json.loads((out_dir / "first.json").read_text())
    second = json.loads((out_dir / "second.json").read_text())
    assert first["steps"] == second["steps"] == 4 and first["note"] == "suite run first"
    assert (out_dir / "first" / "metrics.jsonl").is_file() and not (out_dir / "capped.json").exists()
    heading, _, *verdicts = (out_dir / "verdicts.md").read_text().splitlines()
    assert heading == f"suite.yaml, {first['date']}, cpu, commit {benchmark.source_commit()}"
    assert [line.split(" | ")[0] for line in verdicts[2:]] == ["| first", "| capped", "| second"]
    assert " | met by " in verdicts[2] and "tokens/s against 1 tokens/s" in verdicts[2]
    assert " | — | failed: " in verdicts[3] and "GPU" in verdicts[3]  # the cap's own one-line error
    ratio = second["tokens_per_second_per_gpu"] / first["tokens_per_second_per_gpu"]
    assert f"({ratio:.3f}x against 0.000x)" in verdicts[4]
    # The two finished runs' rows were appended to the results table, in order, and name the suite run.
    added = markdown.read_text().splitlines()[len(shipped_table.splitlines()) :]
    assert len(added) == 2 and "suite run first" in added[0] and "suite run second" in added[1]


def test_profile_twin_profiles_the_steps_after_warm_up_and_renders_the_kernel_groups(tmp_path, monkeypatch):
    spec = benchmark_suite.load_suite(SHIPPED)["esm2_650m_bf16"]
    launched = []

    def fake_run(args):  # stands in for the GPU run: records what it was asked, writes a trace with GPU kernels
        launched.append(args)
        Path(args.output_dir).mkdir(parents=True)
        kernels = [
            {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 40, "pid": 0, "tid": 7}
            for ts, name in enumerate(["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "fused_rope_forward_kernel"] * 3)
        ]
        (Path(args.output_dir) / "profile_rank0.json").write_text(json.dumps({"traceEvents": kernels}))
        return {}

    monkeypatch.setattr(benchmark, "run_benchmark", fake_run)
    text = benchmark_suite.profile_run("esm2_650m_bf16", spec, tmp_path, tmp_path / "out")
    (args,) = launched
    window = ["profiler.enabled=true", "profiler.kind=torch", "profiler.start_step=16", "profiler.end_step=18"]
    assert args.steps == 18 and args.override == [*spec["overrides"], *window]  # steps 16-18, after 15 of warm-up
    assert args.output_dir == str(tmp_path / "out" / "esm2_650m_bf16.profile")
    assert text.startswith("**esm2_650m_bf16: kernel groups per step (3 profiled steps)**")
    assert "| GEMM |" in text and "| RoPE |" in text
    # A recipe without a profiler group (the Lightning recipe) is named, not launched.
    codon = {**spec, "recipe": "recipes/codonfm_ptl_te", "config": "encodon_80m"}
    assert "has no `profiler` config group" in benchmark_suite.profile_run("codon", codon, tmp_path, tmp_path / "o")
    assert len(launched) == 1


def test_a_cpu_suite_with_profile_runs_the_twin_and_says_why_it_has_no_gpu_summary(tmp_path):
    benchmark.write_synthetic_parquet("protein:64", tmp_path)
    out_dir = tmp_path / "out"
    argv = [str(write_suite(tmp_path, {"first": tiny_run()})), "--data-dir", str(tmp_path), "--out-dir", str(out_dir)]
    assert benchmark_suite.main([*argv, "--profile"]) == 0
    assert (out_dir / "first.profile" / "profile_rank0.json").is_file()  # the twin ran with the torch profiler on
    assert json.loads((out_dir / "first.profile" / "summary.json").read_text())["steps"] == 2 + 3
    assert (out_dir / "profiles.md").read_text().startswith("**first**: no profile summary: the trace holds no GPU")
