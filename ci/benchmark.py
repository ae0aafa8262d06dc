"""Benchmark a recipe entrypoint: run it for a fixed number of steps and report one result row.

    python3 ci/benchmark.py --recipe recipes/esm2_native_te --entrypoint train_fsdp2.py --config L1_650M \\
        --nproc 1 --steps 100 --data /data/uniref50_sample.parquet
    python3 ci/benchmark.py ... --synthetic protein:20000          # no data at hand: realistic synthetic lengths
    python3 ci/benchmark.py ... --override fp8_config.enabled=true --markdown docs/benchmarks.md
    python3 ci/benchmark.py ... --gpu-memory-gib 78              # on an H200: does it fit an 80 GB H100?
    python3 ci/benchmark.py --recipe recipes/esm2_accelerate_te --entrypoint train.py --config L1_650M \
        --accelerate-config accelerate_config/fsdp2_te.yaml ...   # `accelerate launch` instead of torchrun
    python3 ci/benchmark.py --recipe recipes/codonfm_ptl_te --entrypoint train.py --config encodon_80m \
        --data ../shared/data/codon_sample.parquet ...            # a recipe whose data group is `data` (Lightning)

The recipe's perf logger does the measuring (see docs/benchmarks.md for the definitions and the MFU formula):
median unpadded tokens/s/GPU and MFU over the logged windows after warm-up, step time, peak memory. This script
launches the run with checkpointing and export off, reads the run's ``summary.json`` and the resolved Hydra
config, and prints the result as JSON and as a row of the docs/benchmarks.md table (``--markdown`` appends it and
redraws the chart beside it, docs/benchmarks.svg). The run's whole output is also kept in the run directory
(``benchmark.log``); a run that fails ends this script with one ``benchmark: error: ...`` line naming the cause (out of
memory first) and that file.
It must run on the machine being measured; it never asserts on a number.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from plot_benchmarks import read_results, render_svg


REPO_ROOT = Path(__file__).resolve().parents[1]
# UniProt amino-acid background frequencies (%), for synthetic protein sequences.
AMINO_ACIDS = {
    "A": 8.25, "R": 5.53, "N": 4.06, "D": 5.45, "C": 1.37, "Q": 3.93, "E": 6.75, "G": 7.07, "H": 2.27, "I": 5.96,
    "L": 9.66, "K": 5.84, "M": 2.42, "F": 3.86, "P": 4.70, "S": 6.56, "T": 5.34, "W": 1.08, "Y": 2.92, "V": 6.87,
}  # fmt: skip


def synthetic_sequences(kind: str, count: int, seed: int = 0) -> list[str]:
    """Random sequences with a realistic length distribution: proteins log-normal around ~350 residues (UniRef-like,
    30..2000), DNA windows of 1,000..8,192 bases, coding sequences of whole codons log-normal around ~330 codons
    (50..2000 codons). Throughput depends on lengths, not on the letters."""
    rng = np.random.default_rng(seed)
    if kind == "codon":
        codons = np.clip(rng.lognormal(mean=5.8, sigma=0.6, size=count), 50, 2000).astype(int)
        return ["".join(rng.choice(list("ACGT"), size=3 * n)) for n in codons]
    if kind == "protein":
        lengths = np.clip(rng.lognormal(mean=5.6, sigma=0.7, size=count), 30, 2000).astype(int)
        letters, weights = list(AMINO_ACIDS), np.array(list(AMINO_ACIDS.values()))
    elif kind == "dna":
        lengths = rng.integers(1000, 8193, size=count)
        letters, weights = list("ACGT"), np.ones(4)
    else:
        raise ValueError(f"--synthetic kind must be 'protein' or 'dna' (or 'codon'), got {kind!r}")
    probabilities = weights / weights.sum()
    return ["".join(rng.choice(letters, size=n, p=probabilities)) for n in lengths]


def write_synthetic_parquet(spec: str, directory: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind, _, count = spec.partition(":")
    sequences = synthetic_sequences(kind, int(count or 10_000))
    path = directory / f"synthetic_{kind}.parquet"
    pq.write_table(pa.table({"id": [f"seq{i}" for i in range(len(sequences))], "sequence": sequences}), path)
    return path


def resolved_config(recipe: Path, config: str, overrides: list[str]) -> dict:
    """The run's Hydra config as the entrypoint composes it (named config + overrides)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(recipe / "hydra_config"), version_base="1.3"):
        cfg = compose(config_name=config, overrides=overrides)
    # Unresolved: `${hydra:...}` needs a running Hydra app, and the keys read here are plain values.
    return OmegaConf.to_container(cfg, resolve=False)


def data_key(recipe: Path, config: str) -> str:
    """The override that points a recipe at its data: ``dataset.path``, or ``data.train_path`` in a recipe whose data
    group is ``data`` (recipes/codonfm_ptl_te, the Lightning DataModule's settings)."""
    cfg = resolved_config(recipe, config, [])
    return "data.train_path" if "dataset" not in cfg and "train_path" in cfg.get("data", {}) else "dataset.path"


def accelerate_precision(accelerate_cfg: dict) -> str:
    """The precision column of a run whose accelerate config file (not the Hydra config) sets it."""
    mixed = accelerate_cfg.get("mixed_precision", "no")
    if mixed == "fp8":
        fp8 = accelerate_cfg.get("fp8_config", {})
        return f"fp8 {fp8.get('backend', 'TE')} {fp8.get('fp8_format', 'HYBRID')} (accelerate fp8_config) layers all"
    return f"{mixed} (fp32 master weights)" if mixed in ("bf16", "fp16") else "fp32"


def describe(cfg: dict, accelerate_cfg: dict | None = None) -> dict:
    """Columns of the benchmarks table that come from the configuration rather than from the measurement."""
    data = cfg["dataset"] if "dataset" in cfg else cfg["data"]
    trainer = cfg.get("trainer", {})  # Lightning: precision and gradient accumulation are Trainer arguments
    fp8, fp4 = cfg.get("fp8_config", {}), cfg.get("fp4_config", {})
    if accelerate_cfg is not None:
        precision = accelerate_precision(accelerate_cfg)
        if accelerate_cfg.get("mixed_precision") == "fp8" and (
            cfg.get("fp8_layers") or cfg.get("keep_first_last_bf16")
        ):
            precision = precision.replace("layers all", "layers per fp8_layers/keep_first_last_bf16")
    elif fp8.get("enabled") or fp4.get("enabled"):
        # E4M3 (the defaults') goes unnamed; HYBRID (E5M2 gradients) is named, as a config may set it silently.
        fmt = f" {fp8['fp8_format']}" if fp8.get("fp8_format") not in (None, "E4M3") else ""
        parts = (
            [f"fp8 {fp8.get('fp8_recipe')}{fmt} layers {fp8.get('fp8_layers') or 'all'}"] if fp8.get("enabled") else []
        )
        parts += [f"fp4 layers {fp4.get('fp4_layers') or 'all'}"] if fp4.get("enabled") else []
        precision = ", ".join(parts)
    elif "precision" in trainer:
        precision = "bf16 (fp32 master weights)" if trainer["precision"] == "bf16-mixed" else trainer["precision"]
    else:
        mixed = cfg.get("mixed_precision", {})
        precision = "bf16" + (" (fp32 master weights)" if mixed.get("fp32_master_weights") else "")
    if "input_format" not in data:  # an image recipe: micro-batches of images (run_benchmark adds tokens per image)
        data = {**data, "input_format": "images"}
        tokens = data["micro_batch_size"]
    elif data["input_format"] == "thd":
        tokens = data["token_budget"]
    else:
        tokens = data["micro_batch_size"] * data["max_seq_length"]
    cp = cfg.get("cp_size", 1)
    return {
        "model": Path(cfg["model_tag"]).name,
        "input_format": data["input_format"] + (f", cp={cp}" if cp and cp > 1 else ""),
        "precision": precision,
        "tokens_per_micro_batch": tokens,
        "grad_acc_steps": cfg.get("grad_acc_steps", trainer.get("accumulate_grad_batches", 1)),
    }


def markdown_row(result: dict) -> str:
    """One row in the column order of docs/benchmarks.md."""
    cells = [
        result["date"],
        result["device"],
        result["gpus"],
        result["model"],
        f"`{result['recipe']}/{result['entrypoint']} --config-name {result['config']}`"
        + (f" (accelerate `{result['accelerate_config']}`)" if result.get("accelerate_config") else "")
        + (f" `{' '.join(result['overrides'])}`" if result["overrides"] else ""),
        result["input_format"],
        result["precision"],
        f"{result['tokens_per_micro_batch']:,}",
        f"{result['tokens_per_second_per_gpu']:,.0f}",
        f"{result['step_time_s']:.3f} s",
        f"{100 * result['mfu']:.1f}%",
        f"{result['peak_memory_gb']:.1f} GB",
        f"{result['steps']} steps, data: {result['data']}"
        + (f"; memory capped at {result['gpu_memory_cap_gib']:g} GiB" if result.get("gpu_memory_cap_gib") else "")
        + (
            f"; {result['images_per_second_per_gpu']:,.0f} images/s/GPU"
            if result.get("images_per_second_per_gpu")
            else ""
        )
        + (f"; commit {result['commit']}" if result.get("commit") else "")
        + (f"; {result['note']}" if result.get("note") else ""),
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


COMMIT_VARIABLE = "BENCHMARK_SOURCE_COMMIT"


def source_commit() -> str | None:
    """The commit of the code being measured, ``+dirty`` when tracked files differ from it; None outside a git
    checkout, where the notes must name the commit by hand. ``$BENCHMARK_SOURCE_COMMIT``, when set, is taken as is:
    for a working tree copied to a GPU machine whose ``.git`` is not that tree's own (it may name an older commit
    with the newer files as changes, which would read ``<old>+dirty``)."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    try:
        git = ["git", "-C", str(REPO_ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if changed.stdout.strip() else "")


def run_and_log(command: list[str], cwd: Path, log: Path) -> int:
    """Run ``command``, echoing its output (stdout and stderr, interleaved as printed) and keeping it in ``log``: a
    failed run on a remote GPU machine is then explained by the file, not by a terminal that is gone."""
    with (
        log.open("w") as kept,
        subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as process,
    ):
        for line in process.stdout:
            sys.stdout.write(line)
            kept.write(line)
        sys.stdout.flush()
    return process.returncode


# The lines that name why a run failed: a Python exception ("torch.OutOfMemoryError: CUDA out of memory. ...") or a
# recipe's own one-line refusal ("error: ..."). torchrun's summary of the failed child says nothing of the cause.
_EXCEPTION_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)\b.*")
_USER_ERROR_LINE = re.compile(r"^(?:\S+: )?error: .+")


def failure_cause(output: str) -> str:
    """The most telling line of a failed run's output: running out of GPU memory first (every rank that hits it
    prints a long traceback, and other errors follow it as ranks die), then the last exception or ``error:`` line
    that is not torchrun's own report."""
    lines = [line.strip() for line in output.splitlines()]
    for line in reversed(lines):
        if "OutOfMemoryError" in line or "CUDA out of memory" in line:
            return f"out of memory ({line[:300]})"
    for line in reversed(lines):
        if ("ChildFailedError" not in line and _EXCEPTION_LINE.match(line)) or _USER_ERROR_LINE.match(line):
            return line[:300]
    return "no exception in its output"


def run_benchmark(args: argparse.Namespace) -> dict:
    recipe = (REPO_ROOT / args.recipe).resolve() if not Path(args.recipe).is_absolute() else Path(args.recipe)
    if not (recipe / args.entrypoint).exists():
        raise SystemExit(f"no entrypoint {recipe / args.entrypoint}")
    workdir = Path(tempfile.mkdtemp(prefix="benchmark."))
    data = Path(args.data).resolve() if args.data else write_synthetic_parquet(args.synthetic, workdir)
    output_dir = Path(args.output_dir).resolve() if args.output_dir else workdir / "run"
    overrides = [
        f"output_dir={output_dir}",
        f"{data_key(recipe, args.config)}={data}",
        f"num_train_steps={args.steps}",
        f"logger.log_every={args.log_every}",
        f"logger.warmup_steps={args.warmup}",
        "checkpoint.resume=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final=false",
        "export_final_model=false",
        *args.override,
    ]
    if args.accelerate_config:
        launcher = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
            "--num_processes", str(args.nproc),
        ]  # fmt: skip
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    entrypoint = [args.entrypoint]
    if args.gpu_memory_gib is not None:  # each rank runs the entrypoint through the cap
        entrypoint = [str(REPO_ROOT / "ci" / "gpu_memory_cap.py"), str(args.gpu_memory_gib), args.entrypoint]
    command = [*launcher, *entrypoint, "--config-name", args.config, *overrides]
    print("+", " ".join(command), flush=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    log = output_dir / "benchmark.log"
    returncode = run_and_log(command, recipe, log)
    if returncode != 0:
        raise SystemExit(
            f"benchmark: error: {args.entrypoint} exited with {returncode}: {failure_cause(log.read_text())} "
            f"(its whole output: {log})"
        )
    summary = json.loads((output_dir / "summary.json").read_text())
    cfg = resolved_config(recipe, args.config, overrides)
    accelerate_cfg = yaml.safe_load((recipe / args.accelerate_config).read_text()) if args.accelerate_config else None
    described = describe(cfg, accelerate_cfg)
    images = {}
    if "tokens_per_image" in summary:  # recipes/vit: a micro-batch is images of tokens_per_image tokens each
        described["input_format"] = f"images of {summary['tokens_per_image']} tokens"
        described["tokens_per_micro_batch"] *= summary["tokens_per_image"]
        images["images_per_second_per_gpu"] = summary["median_images_per_second_per_gpu"]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": summary.get("device", "cpu"),
        "gpus": summary["world_size"],
        "recipe": recipe.name,
        "entrypoint": args.entrypoint,
        "config": args.config,
        "overrides": args.override,
        "accelerate_config": args.accelerate_config,
        **described,
        **images,
        "tokens_per_second_per_gpu": summary["median_tokens_per_second_per_gpu"],
        "step_time_s": summary["median_step_time_s"],
        "mfu": summary["median_mfu"],
        "peak_memory_gb": summary["peak_memory_gb"],
        "steps": summary["steps"],
        "windows_in_medians": summary.get("logged_windows_in_medians"),
        "data": Path(args.data).name if args.data else f"synthetic {args.synthetic}",
        "gpu_memory_cap_gib": args.gpu_memory_gib,
        "commit": source_commit(),
        "note": args.note,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="recipe folder, e.g. recipes/esm2_native_te")
    parser.add_argument("--entrypoint", default="train_fsdp2.py")
    parser.add_argument("--config", required=True, help="Hydra config name, e.g. L1_650M")
    parser.add_argument(
        "--accelerate-config",
        help="launch with `accelerate launch --config_file` this file (relative to the recipe) instead of torchrun",
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) on this machine")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the medians")
    parser.add_argument("--log-every", type=int, default=10)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="dataset.path (or data.train_path) for the run")
    source.add_argument("--synthetic", help="KIND[:COUNT]: protein, dna or codon sequences with realistic lengths")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="cap each process's CUDA allocator at this many GiB (ci/gpu_memory_cap.py): does the run fit a smaller "
        "GPU? 78 stands for an 80 GB H100",
    )
    parser.add_argument("--output-dir", help="run directory (default: a temporary one)")
    parser.add_argument("--note", help="appended to the row's notes (what the run compares, which lease, ...)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--markdown", type=Path, help="append the table row to this file (docs/benchmarks.md)")
    return parser


def append_row(markdown: Path, row: str) -> None:
    """Append ``row`` to the results table in ``markdown`` and redraw the chart beside it (same name, ``.svg``)."""
    with markdown.open("a") as handle:
        handle.write(row + "\n")
    markdown.with_suffix(".svg").write_text(render_svg(read_results(markdown.read_text())))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    result = run_benchmark(args)
    row = markdown_row(result)
    print(json.dumps(result, indent=2))
    print(row)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        append_row(args.markdown, row)


if __name__ == "__main__":
    main()
