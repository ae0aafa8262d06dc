"""ci/plot_benchmarks.py: reading the results table and drawing it, against hand-written tables."""

import re
import sys
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "ci"))
import plot_benchmarks  # noqa: E402


HEADER = (
    "| date | device | GPUs | model | config | input format | precision | tokens/micro-batch | tokens/s/GPU "
    "| step time | MFU | peak memory | notes |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)
ROW_A = "| 2026-11-22 | NVIDIA H200 | 1 | esm2_650M | `x` | thd | bf16 | 32,768 | 95,854 | 0.340 s | 40.1% | 52.9 GB | a |\n"
ROW_B = (
    "| 2026-11-23 | NVIDIA H100 | 2 | llama_1B | `y` | thd | fp8 | 8,192 | 47,927 | 0.171 s | 61.0% | 40.0 GB | b |\n"
)


def test_rows_are_read_by_column_name():
    rows = plot_benchmarks.read_results("# Benchmarks\n\n## Results\n\n" + HEADER + ROW_A + ROW_B)
    assert [(r.model, r.gpus, r.tokens_per_second_per_gpu, r.mfu_percent) for r in rows] == [
        ("esm2_650M", 1, 95854.0, 40.1),
        ("llama_1B", 2, 47927.0, 61.0),
    ]


def test_bars_scale_to_the_fastest_run():
    svg = plot_benchmarks.render_svg(plot_benchmarks.read_results("## Results\n" + HEADER + ROW_A + ROW_B))
    widths = [float(w) for w in re.findall(r'<rect x="\d+" y="\d+" width="([\d.]+)"', svg)]
    assert widths == pytest.approx([plot_benchmarks.BAR_AREA, plot_benchmarks.BAR_AREA / 2], rel=1e-3)
    assert "95,854 (40.1% MFU)" in svg and "llama_1B, thd, fp8 (2× NVIDIA H100, 2026-11-23)" in svg


def test_an_empty_table_draws_a_note():
    assert "No results recorded yet." in plot_benchmarks.render_svg(
        plot_benchmarks.read_results("## Results\n" + HEADER)
    )


@pytest.mark.parametrize(
    ("markdown", "message"),
    [
        ("# no results here", "no '## Results' section"),
        ("## Results\n| date | device |\n|---|---|\n", "lacks columns"),
        ("## Results\n" + HEADER + "| 2026-11-22 | H200 |\n", "has 2 cells"),
    ],
)
def test_malformed_tables_are_named(markdown, message):
    with pytest.raises(ValueError, match=message):
        plot_benchmarks.read_results(markdown)


def test_the_committed_chart_is_current():
    """docs/benchmarks.svg is what the script draws from docs/benchmarks.md: rerun it after adding a result."""
    docs = REPO_ROOT / "docs"
    expected = plot_benchmarks.render_svg(plot_benchmarks.read_results((docs / "benchmarks.md").read_text()))
    assert (docs / "benchmarks.svg").read_text() == expected


def test_smaller_tables_in_the_prose_before_the_results_table_are_skipped():
    prose = "## Results\n\nA profile:\n\n| kernel group | ms/step |\n|---|---|\n| GEMM | 90.3 |\n\nThe runs:\n\n"
    rows = plot_benchmarks.read_results(prose + HEADER + ROW_A)
    assert [(r.model, r.tokens_per_second_per_gpu) for r in rows] == [("esm2_650M", 95854.0)]
