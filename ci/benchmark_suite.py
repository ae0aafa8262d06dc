"""Run a suite of benchmarks against their targets: every run through ci/benchmark.py, then one table of verdicts.

    python3 ci/benchmark_suite.py ci/benchmark_suites/targets_1gpu.yaml --data-dir ../shared/data --out-dir /tmp/suite
    python3 ci/benchmark_suite.py SUITE --only esm2_3b_bf16,esm2_3b_fp8 ...   # some runs (a speed-up needs its base)
    python3 ci/benchmark_suite.py SUITE --dry-run                           # check the suite, print the commands
    python3 ci/benchmark_suite.py SUITE ... --markdown docs/benchmarks.md   # also append each run's row there
    python3 ci/benchmark_suite.py SUITE ... --profile                       # and each run's kernel groups per step

A suite file (YAML) has ``defaults`` (steps, warmup, log_every, nproc) and ``runs``: each names a recipe entrypoint,
Hydra config, data file, overrides and a target (the keys are listed at the top of
ci/benchmark_suites/targets_1gpu.yaml). Before anything runs, every run is checked: the entrypoint and data file
exist and the config composes with the overrides, so a renamed key fails in seconds rather than after the runs
before it. A run that fails (out of memory, an exception) does not stop the others; its verdict names the cause.

Out dir: ``NAME/`` (each run's directory with ``benchmark.log``, ``metrics.jsonl`` and ``summary.json``),
``NAME.json`` (ci/benchmark.py's result) and ``verdicts.md`` (the table printed at the end). With ``--profile``, each
finished run gets a twin that runs the same config for 3 steps past its warm-up under the torch profiler
(``NAME.profile/``; not a result, the profiler slows it), and ``profiles.md`` holds each one's kernel groups per step
(ci/profile_summary.py), the summary docs/benchmarks.md keeps beside a headline number. The exit status is 1
when a run failed, else 0: a missed target is a measurement, not an error. Like ci/benchmark.py, this runs on the
machine being measured and asserts on no number.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

import yaml


sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark
import profile_summary


REPO_ROOT = benchmark.REPO_ROOT
RUN_KEYS = {
    "asks", "recipe", "entrypoint", "config", "data", "overrides", "accelerate_config", "gpu_memory_gib", "nproc",
    "steps", "warmup", "log_every", "target",
}  # fmt: skip
# ci/benchmark.py's own defaults, for a suite that leaves them out.
BUILTIN_DEFAULTS = {
    "entrypoint": "train_fsdp2.py",
    "overrides": [],
    "nproc": 1,
    "steps": 100,
    "warmup": 20,
    "log_every": 10,
}
DEFAULT_KEYS = {"nproc", "steps", "warmup", "log_every"}
TARGET_KINDS = {"tokens_per_second_per_gpu", "mfu", "fits", "speedup_over"}
PROFILED_STEPS = 3  # the window of a --profile run, right after the measured run's warm-up


class SuiteError(ValueError):
    """A suite file that cannot run as written; the message names the run and the key."""


def load_suite(path: Path) -> dict[str, dict]:
    """The suite's runs by name, each with the defaults filled in, after checking every key and target."""
    if not path.is_file():
        raise SuiteError(f"no suite file {path}")
    try:
        suite = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise SuiteError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(suite, dict) or not isinstance(suite.get("runs"), dict) or not suite["runs"]:
        raise SuiteError(f"{path}: expected a mapping with a non-empty 'runs' mapping")
    if unknown := set(suite) - {"defaults", "runs"}:
        raise SuiteError(f"{path}: unknown top-level key(s) {sorted(unknown)}; expected 'defaults' and 'runs'")
    defaults = suite.get("defaults") or {}
    if unknown := set(defaults) - DEFAULT_KEYS:
        raise SuiteError(f"{path}: unknown key(s) {sorted(unknown)} in defaults; allowed: {sorted(DEFAULT_KEYS)}")
    runs = {}
    for name, spec in suite["runs"].items():
        if not isinstance(spec, dict):
            raise SuiteError(f"{path}: run {name!r} must be a mapping")
        if unknown := set(spec) - RUN_KEYS:
            raise SuiteError(f"{path}: run {name!r} has unknown key(s) {sorted(unknown)}; allowed: {sorted(RUN_KEYS)}")
        if missing := {"recipe", "config", "data", "target"} - set(spec):
            raise SuiteError(f"{path}: run {name!r} lacks {sorted(missing)}")
        runs[name] = {**BUILTIN_DEFAULTS, **defaults, **spec}
        check_types(path, name, runs[name])
    for name, spec in runs.items():
        check_target(path, name, spec["target"], runs)
    return runs


def check_types(path: Path, name: str, spec: dict) -> None:
    """Counts are positive integers, overrides a list of ``key=value`` strings, the memory cap a number."""
    for key in ("nproc", "steps", "warmup", "log_every"):
        value = spec[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "warmup" else 1):
            raise SuiteError(
                f"{path}: run {name!r}: {key} must be a {'non-negative' if key == 'warmup' else 'positive'} integer, got {value!r}"
            )
    overrides = spec["overrides"]
    if not isinstance(overrides, list) or not all(isinstance(item, str) and "=" in item for item in overrides):
        raise SuiteError(f"{path}: run {name!r}: overrides must be a list of key=value strings, got {overrides!r}")
    cap = spec.get("gpu_memory_gib")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
        raise SuiteError(f"{path}: run {name!r}: gpu_memory_gib must be a positive number of GiB, got {cap!r}")


def check_target(path: Path, name: str, target: object, runs: dict[str, dict]) -> None:
    if not isinstance(target, dict) or len(target) != 1 or next(iter(target)) not in TARGET_KINDS:
        raise SuiteError(f"{path}: run {name!r}: target must be one of {sorted(TARGET_KINDS)}, got {target!r}")
    ((kind, value),) = target.items()
    if kind == "speedup_over":
        if not isinstance(value, dict) or set(value) != {"run", "at_least"}:
            raise SuiteError(f"{path}: run {name!r}: speedup_over takes {{run: NAME, at_least: RATIO}}, got {value!r}")
        if value["run"] not in runs or value["run"] == name:
            raise SuiteError(
                f"{path}: run {name!r}: speedup_over names {value['run']!r}, not another run of the suite"
            )
    elif kind == "fits":
        if value is not True:
            raise SuiteError(f"{path}: run {name!r}: the fits target is written 'fits: true'")
    elif not isinstance(value, (int, float)) or value <= 0:
        raise SuiteError(f"{path}: run {name!r}: {kind} must be a positive number, got {value!r}")


def select(runs: dict[str, dict], only: str | None) -> dict[str, dict]:
    """The runs named in ``--only`` (all when None), in suite order; a speed-up's base must be among them, because a
    ratio is only worth reporting from one lease."""
    if only is None:
        return runs
    names = [name.strip() for name in only.split(",") if name.strip()]
    if unknown := [name for name in names if name not in runs]:
        raise SuiteError(f"--only names no run {unknown}; the suite has {list(runs)}")
    chosen = {name: spec for name, spec in runs.items() if name in names}
    for name, spec in chosen.items():
        base = spec["target"].get("speedup_over", {}).get("run")
        if base is not None and base not in chosen:
            raise SuiteError(f"run {name!r} is compared with {base!r} in the same lease: add {base} to --only")
    return chosen


def benchmark_argv(name: str, spec: dict, data_dir: Path, out_dir: Path) -> list[str]:
    """The ci/benchmark.py arguments of one run."""
    argv = [
        "--recipe", spec["recipe"], "--entrypoint", spec["entrypoint"], "--config", spec["config"],
        "--nproc", str(spec["nproc"]), "--steps", str(spec["steps"]), "--warmup", str(spec["warmup"]),
        "--log-every", str(spec["log_every"]), "--data", str(data_dir / spec["data"]),
        "--output-dir", str(out_dir / name), "--json", str(out_dir / f"{name}.json"), "--note", f"suite run {name}",
    ]  # fmt: skip
    if spec.get("accelerate_config"):
        argv += ["--accelerate-config", spec["accelerate_config"]]
    if spec.get("gpu_memory_gib") is not None:
        argv += ["--gpu-memory-gib", str(spec["gpu_memory_gib"])]
    for override in spec["overrides"]:
        argv += ["--override", override]
    return argv


def profile_argv(name: str, spec: dict, data_dir: Path, out_dir: Path) -> list[str]:
    """The ci/benchmark.py arguments of a run's profiled twin: the same config for ``warmup + PROFILED_STEPS`` steps,
    the torch profiler over the last ``PROFILED_STEPS`` (its speed is not a result: the profiler slows the step)."""
    start = spec["warmup"] + 1
    window = [
        "profiler.enabled=true", "profiler.kind=torch",
        f"profiler.start_step={start}", f"profiler.end_step={start + PROFILED_STEPS - 1}",
    ]  # fmt: skip
    twin = {**spec, "steps": start + PROFILED_STEPS - 1, "overrides": [*spec["overrides"], *window]}
    return benchmark_argv(f"{name}.profile", twin, data_dir, out_dir)


def profile_run(name: str, spec: dict, data_dir: Path, out_dir: Path) -> str:
    """Run the profiled twin and return its kernel groups per step (ci/profile_summary.py's table), the summary
    docs/benchmarks.md keeps beside a headline number; or one line saying why there is none."""
    if "profiler" not in benchmark.resolved_config(REPO_ROOT / spec["recipe"], spec["config"], []):
        return f"**{name}**: not profiled ({spec['recipe']} has no `profiler` config group)"
    try:
        benchmark.run_benchmark(benchmark.build_parser().parse_args(profile_argv(name, spec, data_dir, out_dir)))
        trace = json.loads((out_dir / f"{name}.profile" / "profile_rank0.json").read_text())
        summary = profile_summary.summarise(trace, PROFILED_STEPS)
    except SystemExit as failure:
        return f"**{name}**: the profiled run failed: {str(failure.code).removeprefix('benchmark: error: ')}"
    except (OSError, ValueError) as error:  # no trace written, or one without GPU kernels (a CPU run)
        return f"**{name}**: no profile summary: {error}"
    return profile_summary.render(summary, f"{name}: kernel groups per step ({PROFILED_STEPS} profiled steps)")


def check_runs(runs: dict[str, dict], data_dir: Path, need_data: bool = True) -> None:
    """Fail before the first run if any run cannot start: a missing entrypoint or data file, or a config that does
    not compose with its overrides (a renamed key)."""
    for name, spec in runs.items():
        recipe = REPO_ROOT / spec["recipe"]
        if not (recipe / spec["entrypoint"]).is_file():
            raise SuiteError(f"run {name!r}: no entrypoint {recipe / spec['entrypoint']}")
        if need_data and not (data_dir / spec["data"]).is_file():
            raise SuiteError(f"run {name!r}: no data file {data_dir / spec['data']} (see --data-dir)")
        try:
            benchmark.resolved_config(recipe, spec["config"], list(spec["overrides"]))
        except Exception as error:  # Hydra's errors differ by kind (missing config, unknown key, bad value)
            raise SuiteError(f"run {name!r}: config {spec['config']} with {spec['overrides']}: {error}") from error


def verdict(spec: dict, result: dict | None, error: str | None, results: dict[str, dict | None]) -> str:
    """The target's verdict in words: met or missed and by how much, or why there is none."""
    ((kind, value),) = spec["target"].items()
    if result is None:
        if kind == "fits" and error and "out of memory" in error:
            cap = spec.get("gpu_memory_gib")
            return f"does not fit{f' under a {cap:g} GiB cap' if cap else ''}: {error}"
        return f"failed: {error}"
    if kind == "fits":
        cap = spec.get("gpu_memory_gib")
        return f"fits ({result['peak_memory_gb']:.1f} GB peak" + (f" under a {cap:g} GiB cap)" if cap else ")")
    if kind == "speedup_over":
        base = results.get(value["run"])
        if base is None:
            return f"not compared: {value['run']} failed"
        measured = result["tokens_per_second_per_gpu"] / base["tokens_per_second_per_gpu"]
        asked, unit = value["at_least"], "x"
    elif kind == "mfu":
        measured, asked, unit = result["mfu"], value, "MFU"
    else:
        measured, asked, unit = result["tokens_per_second_per_gpu"], value, "tokens/s"
    relative = measured / asked - 1
    met = "met" if relative >= 0 else "missed"
    return f"{met} by {abs(100 * relative):.1f}% ({format_value(measured, unit)} against {format_value(asked, unit)})"


def format_value(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.3f}x"
    if unit == "MFU":
        return f"{100 * value:.1f}% MFU"
    return f"{value:,.0f} tokens/s"


def verdicts_table(runs: dict[str, dict], results: dict[str, dict | None], errors: dict[str, str]) -> str:
    lines = ["| run | asks | measured | verdict |", "|---|---|---|---|"]
    for name, spec in runs.items():
        result = results.get(name)
        measured = (
            f"{result['tokens_per_second_per_gpu']:,.0f} tokens/s, {100 * result['mfu']:.1f}% MFU, "
            f"{result['peak_memory_gb']:.1f} GB on {result['device']}"
            if result
            else "—"
        )
        outcome = verdict(spec, result, errors.get(name), results)
        lines.append(f"| {name} | {spec.get('asks', '')} | {measured} | {outcome} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", type=Path, help="suite file, e.g. ci/benchmark_suites/targets_1gpu.yaml")
    parser.add_argument("--data-dir", type=Path, default=REPO_ROOT.parent / "shared" / "data",
                        help="where the runs' data files are (default: ../shared/data beside the repository)")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, help="where each run's directory, result and the verdicts go")
    parser.add_argument("--only", help="comma-separated run names (default: every run, in the suite's order)")
    parser.add_argument("--dry-run", action="store_true", help="check the suite and print the commands; run nothing")
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"after each finished run, profile {PROFILED_STEPS} steps of the same config and write its kernel groups",
    )
    parser.add_argument(
        "--markdown", type=Path, help="append each finished run's row to this file (docs/benchmarks.md)"
    )
    args = parser.parse_args(argv)
    try:
        runs = select(load_suite(args.suite), args.only)
        data_dir = args.data_dir.resolve()
        check_runs(runs, data_dir, need_data=not args.dry_run)
    except SuiteError as error:
        parser.exit(2, f"benchmark_suite: error: {error}\n")
    if args.out_dir is None and not args.dry_run:
        parser.exit(2, "benchmark_suite: error: --out-dir is required to run the suite\n")
    out_dir = args.out_dir.resolve() if args.out_dir else Path("OUT")  # a dry run without one prints OUT/...
    if args.dry_run:
        for name, spec in runs.items():
            command = ["python3", "ci/benchmark.py", *benchmark_argv(name, spec, data_dir, out_dir)]
            print(f"# {name}: {spec.get('asks', '')}\n{shlex.join(command)}")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict | None] = {}
    errors: dict[str, str] = {}
    profiles: list[str] = []
    for index, (name, spec) in enumerate(runs.items(), start=1):
        print(f"benchmark_suite: run {index}/{len(runs)}: {name}", flush=True)
        try:
            run_args = benchmark.build_parser().parse_args(benchmark_argv(name, spec, data_dir, out_dir))
            results[name] = benchmark.run_benchmark(run_args)
        except SystemExit as failure:  # run_benchmark ends a failed run with its one-line cause
            results[name], errors[name] = None, str(failure.code).removeprefix("benchmark: error: ")
            print(f"benchmark_suite: {name} failed: {errors[name]}", flush=True)
            continue
        (out_dir / f"{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
        if args.markdown:
            benchmark.append_row(args.markdown, benchmark.markdown_row(results[name]))
        if args.profile:
            print(f"benchmark_suite: profiling {name}", flush=True)
            profiles.append(profile_run(name, spec, data_dir, out_dir))
    finished = [result for result in results.values() if result]
    context = (
        finished[0] if finished else {"date": "-", "device": "no finished run", "commit": benchmark.source_commit()}
    )
    heading = f"{args.suite.name}, {context['date']}, {context['device']}, commit {context['commit'] or 'unknown'}\n\n"
    table = heading + verdicts_table(runs, results, errors)
    (out_dir / "verdicts.md").write_text(table)
    print(table)
    if profiles:
        (out_dir / "profiles.md").write_text("\n\n".join(profiles) + "\n")
        print("\n\n".join(profiles))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
