"""ci/benchmark.py: the synthetic data, the table row, and one real (tiny, CPU) run of a recipe entrypoint."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "ci"))
import benchmark  # noqa: E402


def test_synthetic_protein_lengths_look_like_uniref():
    sequences = benchmark.synthetic_sequences("protein", 2000)
    lengths = np.array([len(s) for s in sequences])
    assert lengths.min() >= 30 and lengths.max() <= 2000
    assert 250 < np.median(lengths) < 350  # UniRef50 median is ~300 residues
    assert set("".join(sequences)) <= set(benchmark.AMINO_ACIDS)
    leucine = sum(s.count("L") for s in sequences) / lengths.sum()
    assert abs(leucine - 0.0966) < 0.005


def test_synthetic_dna_and_bad_kind():
    assert all(1000 <= len(s) <= 8192 and set(s) <= set("ACGT") for s in benchmark.synthetic_sequences("dna", 20))
    with pytest.raises(ValueError, match="protein' or 'dna'"):
        benchmark.synthetic_sequences("rna", 5)


def test_describe_reads_precision_and_batch_shape():
    cfg = {
        "model_tag": "model_configs/esm2_t33_650M_UR50D",
        "dataset": {"input_format": "bshd", "micro_batch_size": 16, "max_seq_length": 1024, "token_budget": 1},
        "fp8_config": {"enabled": True, "fp8_recipe": "Float8CurrentScaling", "fp8_layers": [2, 3]},
        "fp4_config": {"enabled": False},
        "cp_size": 2,
    }
    described = benchmark.describe(cfg)
    assert described["model"] == "esm2_t33_650M_UR50D"
    assert described["tokens_per_micro_batch"] == 16 * 1024
    assert described["input_format"] == "bshd, cp=2"
    assert described["precision"] == "fp8 Float8CurrentScaling layers [2, 3]"


def test_describe_takes_the_precision_from_an_accelerate_config():
    cfg = {"model_tag": "model_configs/esm2_t33_650M_UR50D", "dataset": {"input_format": "thd", "token_budget": 4096}}
    assert benchmark.describe(cfg, {"mixed_precision": "bf16"})["precision"] == "bf16 (fp32 master weights)"
    fp8 = {"mixed_precision": "fp8", "fp8_config": {"backend": "TE", "fp8_format": "E4M3"}}
    assert benchmark.describe(cfg, fp8)["precision"] == "fp8 TE E4M3 (accelerate fp8_config) layers all"
    assert "fp8_layers" in benchmark.describe({**cfg, "fp8_layers": [2]}, fp8)["precision"]


def test_tiny_accelerate_launch_on_cpu(tmp_path):
    result_file = tmp_path / "result.json"
    command = [
        sys.executable, str(REPO_ROOT / "ci" / "benchmark.py"),
        "--recipe", "recipes/esm2_accelerate_te", "--entrypoint", "train.py", "--config", "L0_sanity",
        "--accelerate-config", "accelerate_config/cpu.yaml",
        "--steps", "4", "--log-every", "2", "--warmup", "2", "--synthetic", "protein:64",
        "--override", "+model_config_overrides.num_hidden_layers=1", "--json", str(result_file),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(result_file.read_text())
    assert result["steps"] == 4 and result["gpus"] == 1 and result["precision"] == "fp32"
    assert result["accelerate_config"] == "accelerate_config/cpu.yaml" and result["tokens_per_second_per_gpu"] > 0
    assert "(accelerate `accelerate_config/cpu.yaml`)" in benchmark.markdown_row(result)


def test_tiny_cpu_run_reports_a_row_matching_the_benchmarks_table(tmp_path):
    result_file = tmp_path / "result.json"
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text((REPO_ROOT / "docs" / "benchmarks.md").read_text())
    command = [
        sys.executable, str(REPO_ROOT / "ci" / "benchmark.py"),
        "--recipe", "recipes/esm2_native_te", "--entrypoint", "train_ddp.py", "--config", "L0_sanity",
        "--steps", "4", "--log-every", "2", "--warmup", "2", "--synthetic", "protein:64",
        "--override", "+model_config_overrides.num_hidden_layers=1",
        "--json", str(result_file), "--markdown", str(markdown),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(result_file.read_text())
    assert result["steps"] == 4 and result["gpus"] == 1
    assert result["model"] == "esm2_t6_8M_UR50D" and result["input_format"] == "bshd"
    assert result["tokens_per_micro_batch"] == 8 * 128
    assert result["tokens_per_second_per_gpu"] > 0 and result["step_time_s"] > 0
    # The row lands in the results table of (a copy of) docs/benchmarks.md, and the chart beside it is redrawn.
    lines = markdown.read_text().splitlines()
    assert lines[:-1] == (REPO_ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| date | device"))
    assert lines[-1].count("|") == header.count("|")  # same number of columns as the results table
    assert markdown.with_suffix(".svg").read_text().count('fill="#76b900"') == len(lines) - lines.index(header) - 2


def test_describe_reads_a_lightning_recipes_data_and_trainer_groups():
    cfg = {
        "model_tag": "model_configs/encodon_80m",
        "data": {"input_format": "thd", "token_budget": 32768, "micro_batch_size": 8, "max_codons": 2046},
        "trainer": {"precision": "bf16-mixed", "accumulate_grad_batches": 4},
        "fp8_config": {"enabled": False},
    }
    described = benchmark.describe(cfg)
    assert described["tokens_per_micro_batch"] == 32768 and described["grad_acc_steps"] == 4
    assert described["precision"] == "bf16 (fp32 master weights)"
    fp8 = {**cfg, "fp8_config": {"enabled": True, "fp8_recipe": "Float8BlockScaling", "fp8_layers": None}}
    assert benchmark.describe(fp8)["precision"] == "fp8 Float8BlockScaling layers all"
    hybrid = {**cfg, "fp8_config": {"enabled": True, "fp8_recipe": "DelayedScaling", "fp8_format": "HYBRID"}}
    assert benchmark.describe(hybrid)["precision"] == "fp8 DelayedScaling HYBRID layers all"
    e4m3 = {**cfg, "fp8_config": {"enabled": True, "fp8_recipe": "DelayedScaling", "fp8_format": "E4M3"}}
    assert benchmark.describe(e4m3)["precision"] == "fp8 DelayedScaling layers all"


def test_synthetic_codon_sequences_are_whole_codons():
    sequences = benchmark.synthetic_sequences("codon", 200)
    codons = np.array([len(s) // 3 for s in sequences])
    assert all(len(s) % 3 == 0 and set(s) <= set("ACGT") for s in sequences)
    assert codons.min() >= 50 and codons.max() <= 2000 and 250 < np.median(codons) < 450


def test_tiny_lightning_run_reads_the_data_group(tmp_path):
    """recipes/codonfm_ptl_te keeps its data settings in `data` (data.train_path), not `dataset`."""
    result_file = tmp_path / "result.json"
    command = [
        sys.executable, str(REPO_ROOT / "ci" / "benchmark.py"),
        "--recipe", "recipes/codonfm_ptl_te", "--entrypoint", "train.py", "--config", "L0_sanity",
        "--steps", "4", "--log-every", "2", "--warmup", "2", "--synthetic", "codon:64", "--json", str(result_file),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(result_file.read_text())
    assert result["steps"] == 4 and result["model"] == "encodon_80m" and result["input_format"] == "thd"
    assert result["precision"] == "32-true" and result["tokens_per_micro_batch"] == 4096
    assert result["tokens_per_second_per_gpu"] > 0


def test_image_recipe_reports_images_and_tokens_per_micro_batch(tmp_path):
    """recipes/vit: a micro-batch is images; the row counts their tokens (65 per 32-pixel image of the L0 model) and
    adds images/s/GPU."""
    images = tmp_path / "images"
    make_images = REPO_ROOT / "recipes" / "vit" / "scripts" / "make_sample_images.py"
    subprocess.run([sys.executable, str(make_images), str(images), "--per-class", "10"], check=True, timeout=120)
    result_file = tmp_path / "result.json"
    command = [
        sys.executable, str(REPO_ROOT / "ci" / "benchmark.py"),
        "--recipe", "recipes/vit", "--entrypoint", "train_ddp.py", "--config", "L0_sanity",
        "--steps", "4", "--log-every", "2", "--warmup", "2", "--data", str(images),
        "--override", "dataset.num_workers=0", "--override", "validation.every_n_steps=0",
        "--override", "dataset.micro_batch_size=8", "--json", str(result_file),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(result_file.read_text())
    assert result["input_format"] == "images of 65 tokens" and result["tokens_per_micro_batch"] == 8 * 65
    assert result["images_per_second_per_gpu"] == pytest.approx(result["tokens_per_second_per_gpu"] / 65)
    assert "images/s/GPU" in benchmark.markdown_row(result)


TORCHRUN_AFTER_A_FAILED_RANK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "train_ddp.py", line 80, in main
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB
E1127 01:02:03 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 0 (pid: 7)
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_failure_cause_names_out_of_memory_then_the_last_exception_or_user_error():
    assert benchmark.failure_cause(TORCHRUN_AFTER_A_FAILED_RANK).startswith(
        "out of memory ([rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    crashed = "step 3/10 | loss 2.1\nTraceback (most recent call last):\nValueError: bad shape\nChildFailedError:\n"
    assert benchmark.failure_cause(crashed) == "ValueError: bad shape"
    refused = "Error executing job with overrides: [...]\nerror: dataset.path: no such file: /data/x.parquet\n"
    assert benchmark.failure_cause(refused) == "error: dataset.path: no such file: /data/x.parquet"
    assert benchmark.failure_cause("killed\n") == "no exception in its output"


def test_a_failed_run_ends_in_one_error_line_and_keeps_its_output(tmp_path):
    """A run that dies (here: a stand-in entrypoint that runs out of memory) is explained in the last line, and its
    whole output stays in the run directory, where a remote machine's caller can fetch it."""
    recipe = tmp_path / "recipe"
    (recipe / "hydra_config").mkdir(parents=True)
    (recipe / "hydra_config" / "tiny.yaml").write_text("dataset:\n  path: ???\n")
    (recipe / "train.py").write_text(
        "import sys\nprint('step 1/4 | loss 3.0')\n"
        "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB', file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    run_dir = tmp_path / "run"
    command = [
        sys.executable, str(REPO_ROOT / "ci" / "benchmark.py"), "--recipe", str(recipe), "--entrypoint", "train.py",
        "--config", "tiny", "--synthetic", "protein:8", "--output-dir", str(run_dir), "--json", str(tmp_path / "r.json"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("benchmark: error: train.py exited with 1: out of memory (torch.OutOfMemoryError"), last
    assert str(run_dir / "benchmark.log") in last
    kept = (run_dir / "benchmark.log").read_text()
    assert "step 1/4 | loss 3.0" in kept and "Tried to allocate 9.00 GiB" in kept
    assert "step 1/4 | loss 3.0" in result.stdout  # still echoed as it ran
    assert not (tmp_path / "r.json").exists()


def test_gpu_memory_cap_runs_the_entrypoint_as_python_would(tmp_path):
    """ci/gpu_memory_cap.py hands over to the entrypoint as ``python ENTRYPOINT ARGS``: ``__main__``, its arguments,
    and its own folder first on ``sys.path`` (recipes import their sibling modules)."""
    (tmp_path / "sibling.py").write_text("VALUE = 'from the recipe folder'\n")
    (tmp_path / "train.py").write_text("import sys\nimport sibling\nprint(__name__, sys.argv[1:], sibling.VALUE)\n")
    code = (
        f"import gpu_memory_cap; gpu_memory_cap.run_entrypoint({str(tmp_path / 'train.py')!r}, ['--config-name', 'x'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT / "ci", capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "__main__ ['--config-name', 'x'] from the recipe folder"


def test_gpu_memory_cap_without_a_gpu_ends_the_benchmark_in_one_error_line(tmp_path):
    """``--gpu-memory-gib`` launches each rank through ci/gpu_memory_cap.py; without a CUDA GPU (this CPU machine)
    there is nothing to cap, and the benchmark says so in its last line, before the entrypoint runs."""
    recipe = tmp_path / "recipe"
    (recipe / "hydra_config").mkdir(parents=True)
    (recipe / "hydra_config" / "tiny.yaml").write_text("dataset:\n  path: ???\n")
    (recipe / "train.py").write_text("print('the entrypoint ran')\n")
    command = [
        sys.executable, str(REPO_ROOT / "ci" / "benchmark.py"), "--recipe", str(recipe), "--entrypoint", "train.py",
        "--config", "tiny", "--synthetic", "protein:8", "--output-dir", str(tmp_path / "run"), "--gpu-memory-gib", "78",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "gpu_memory_cap: error: no CUDA GPU here" in last, last
    assert "the entrypoint ran" not in result.stdout


def test_the_row_names_the_commit_and_the_note(tmp_path, monkeypatch):
    monkeypatch.delenv(benchmark.COMMIT_VARIABLE, raising=False)
    commit = benchmark.source_commit()
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit)
    result = {
        "date": "2026-12-04", "device": "NVIDIA H200", "gpus": 1, "model": "esm2_t33_650M_UR50D", "recipe": "r",
        "entrypoint": "train_ddp.py", "config": "L1_650M", "overrides": [], "input_format": "thd", "precision": "bf16",
        "tokens_per_micro_batch": 49152, "tokens_per_second_per_gpu": 1.0, "step_time_s": 1.0, "mfu": 0.5,
        "peak_memory_gb": 1.0, "steps": 35, "data": "d.parquet", "commit": commit, "note": "second of ABBA",
    }  # fmt: skip
    assert benchmark.markdown_row(result).endswith(f"| 35 steps, data: d.parquet; commit {commit}; second of ABBA |")
    # A copied tree without git (as on a GPU machine) has no commit to name; the row then says nothing of one.
    monkeypatch.setattr(benchmark, "REPO_ROOT", tmp_path)
    assert benchmark.source_commit() is None
    # A tree copied with a stale .git: the commit it was copied from, as the caller names it.
    monkeypatch.setenv(benchmark.COMMIT_VARIABLE, "57dd776")
    assert benchmark.source_commit() == "57dd776"
    assert "commit" not in benchmark.markdown_row({**result, "commit": None, "note": None})
