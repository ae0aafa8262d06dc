#!/usr/bin/env python3
"""Compare the loss curves of training runs: does a faster or leaner path learn what the plain path learns?

Every recipe's perf logger writes ``<output_dir>/metrics.jsonl``, one line per logged step with ``step`` and ``loss``
(the mean over that logging window). Given the plain run first and the runs to check after it, this prints the
losses side by side at every step all runs logged, the difference of each run from the first, and a verdict against
``--tolerance`` (largest absolute loss difference allowed at any common step):

    python3 ci/compare_losses.py plain=runs/plain/metrics.jsonl recompute=runs/recompute/metrics.jsonl \
        --tolerance 0.01 --markdown

Runs are named ``NAME=PATH`` (or just ``PATH``: the parent folder's name is used). The exit status is 1 when a run
differs by more than the tolerance, and 2 when a file cannot be read or the runs share no logged step, so the script
can gate CI jobs.

Two bf16 runs on a GPU are not bitwise reproducible (atomics in attention backward, cuBLAS split-K choices), so a
tolerance states how much noise is accepted; measure it by repeating the plain run once.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    """One run's logged losses, by step."""

    name: str
    losses: dict[int, float]


def read_metrics(path: Path) -> dict[int, float]:
    """``step -> loss`` from a metrics.jsonl. A resumed run may log a step twice: the later line wins."""
    losses: dict[int, float] = {}
    with path.open() as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not a JSON line ({error.msg})") from None
            if "step" not in record or "loss" not in record:
                raise ValueError(
                    f"{path}:{line_number}: a metrics line needs 'step' and 'loss', found {sorted(record)}"
                )
            losses[int(record["step"])] = float(record["loss"])
    if not losses:
        raise ValueError(f"{path}: no logged steps")
    return losses


def parse_run(spec: str) -> Run:
    """``NAME=PATH`` or ``PATH`` (named after its folder). A folder means its ``metrics.jsonl``."""
    name, sep, path_text = spec.partition("=")
    if not sep:
        name, path_text = "", spec
    path = Path(path_text)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return Run(name or path.parent.name, read_metrics(path))


@dataclass
class Comparison:
    """Each run's largest and mean absolute loss difference from the reference run, over their common steps."""

    steps: list[int]
    max_abs_diff: dict[str, float]
    mean_abs_diff: dict[str, float]


def compare(reference: Run, others: list[Run]) -> Comparison:
    steps = sorted(set(reference.losses).intersection(*(run.losses for run in others)))
    if not steps:
        raise ValueError(f"the runs share no logged step with {reference.name!r}")
    max_diff, mean_diff = {}, {}
    for run in others:
        diffs = [abs(run.losses[step] - reference.losses[step]) for step in steps]
        max_diff[run.name] = max(diffs)
        mean_diff[run.name] = sum(diffs) / len(diffs)
    return Comparison(steps, max_diff, mean_diff)


def _signed(difference: float) -> str:
    """``+0.0012``; a difference that rounds to zero prints as ``+0.0000``, never ``-0.0000``."""
    return f"{round(difference, 4) + 0.0:+.4f}"


def table(reference: Run, others: list[Run], steps: list[int], markdown: bool) -> str:
    """Losses per step, and each run's difference from the reference."""
    header = ["step", reference.name] + [f"{run.name} (Δ)" for run in others]
    rows = [
        [str(step), f"{reference.losses[step]:.4f}"]
        + [f"{run.losses[step]:.4f} ({_signed(run.losses[step] - reference.losses[step])})" for run in others]
        for step in steps
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "runs", nargs="+", help="NAME=PATH to metrics.jsonl (or its folder); the first is the reference"
    )
    parser.add_argument("--tolerance", type=float, help="fail when a run's loss differs by more than this at a step")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give the reference run and at least one run to compare with it")
    try:
        runs = [parse_run(spec) for spec in args.runs]
        names = [run.name for run in runs]
        if len(set(names)) < len(names):  # results are reported by name
            raise ValueError(f"two runs have the same name ({', '.join(names)}): name them with NAME=PATH")
        result = compare(runs[0], runs[1:])
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    reference, others = runs[0], runs[1:]
    print(table(reference, others, result.steps, args.markdown))
    print()
    failed = False
    for run in others:
        verdict = ""
        if args.tolerance is not None:
            within = result.max_abs_diff[run.name] <= args.tolerance
            failed |= not within
            verdict = f"  {'within' if within else 'OUTSIDE'} the tolerance {args.tolerance:g}"
        print(
            f"{run.name} vs {reference.name}: max |Δloss| {result.max_abs_diff[run.name]:.4g}, "
            f"mean {result.mean_abs_diff[run.name]:.4g} over {len(result.steps)} logged steps{verdict}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
