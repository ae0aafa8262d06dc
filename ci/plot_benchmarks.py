"""Draw the results table of docs/benchmarks.md as a bar chart (SVG): unpadded tokens/s/GPU per run, MFU beside it.

    python3 ci/plot_benchmarks.py                      # docs/benchmarks.md -> docs/benchmarks.svg
    python3 ci/plot_benchmarks.py --table T.md --output T.svg

The table is the one ci/benchmark.py appends rows to (its "## Results" section); the chart is plain SVG written
here, so regenerating it needs no plotting library. Run it after recording a result and commit both files.
"""

import argparse
import html
import re
from dataclasses import dataclass
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("date", "device", "GPUs", "model", "config", "input format", "precision", "tokens/s/GPU", "MFU")

BAR_HEIGHT, GAP, LABEL_WIDTH, BAR_AREA, RIGHT_MARGIN, TOP = 22, 10, 620, 360, 140, 40  # pixels


@dataclass
class BenchmarkRow:
    date: str
    device: str
    gpus: int
    model: str
    input_format: str
    precision: str
    tokens_per_second_per_gpu: float
    mfu_percent: float

    @property
    def label(self) -> str:
        return f"{self.model}, {self.input_format}, {self.precision} ({self.gpus}× {self.device}, {self.date})"


def _number(cell: str) -> float:
    match = re.search(r"[\d,]+(\.\d+)?", cell)
    if match is None:
        raise ValueError(f"no number in table cell {cell!r}")
    return float(match.group(0).replace(",", ""))


def read_results(markdown: str) -> list[BenchmarkRow]:
    """The rows of the results table under '## Results': the first table there whose header has the result columns
    (smaller tables in the prose before it, e.g. profile summaries, are skipped)."""
    if "## Results" not in markdown:
        raise ValueError("no '## Results' section in the benchmark table")
    lines = [line.strip() for line in markdown.split("## Results", 1)[1].splitlines()]
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if not tables or all(len(t) < 2 for t in tables):
        raise ValueError("the '## Results' section has no table")
    headers = [[cell.strip() for cell in t[0].strip("|").split("|")] for t in tables]
    found = [i for i, header in enumerate(headers) if all(column in header for column in COLUMNS)]
    if not found:
        missing = [column for column in COLUMNS if column not in headers[-1]]
        raise ValueError(f"the results table lacks columns {missing}")
    table, header = tables[found[0]], headers[found[0]]
    rows = []
    for line in table[2:]:  # after the header and its |---| separator
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != len(header):
            raise ValueError(f"a results row has {len(cells)} cells, the header {len(header)}: {line[:80]}")
        cell = dict(zip(header, cells))
        rows.append(
            BenchmarkRow(
                date=cell["date"],
                device=cell["device"],
                gpus=int(_number(cell["GPUs"])),
                model=cell["model"],
                input_format=cell["input format"],
                precision=cell["precision"],
                tokens_per_second_per_gpu=_number(cell["tokens/s/GPU"]),
                mfu_percent=_number(cell["MFU"]),
            )
        )
    return rows


def render_svg(rows: list[BenchmarkRow]) -> str:
    """Horizontal bars, one per run, scaled to the fastest; each labelled with its run and annotated with MFU."""
    height = TOP + max(len(rows), 1) * (BAR_HEIGHT + GAP) + 20
    width = LABEL_WIDTH + BAR_AREA + RIGHT_MARGIN
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        '<text x="10" y="22" font-size="14" font-weight="bold">Unpadded tokens/s per GPU (median after warm-up)</text>',
    ]
    if not rows:
        parts.append(f'<text x="10" y="{TOP + 15}">No results recorded yet.</text>')
    fastest = max((row.tokens_per_second_per_gpu for row in rows), default=1.0)
    for index, row in enumerate(rows):
        y = TOP + index * (BAR_HEIGHT + GAP)
        bar = BAR_AREA * row.tokens_per_second_per_gpu / fastest
        text_y = y + BAR_HEIGHT * 0.7
        parts += [
            f'<text x="{LABEL_WIDTH - 8}" y="{text_y:.1f}" text-anchor="end">{html.escape(row.label)}</text>',
            f'<rect x="{LABEL_WIDTH}" y="{y}" width="{bar:.1f}" height="{BAR_HEIGHT}" fill="#76b900"/>',
            f'<text x="{LABEL_WIDTH + bar + 6:.1f}" y="{text_y:.1f}">'
            f"{row.tokens_per_second_per_gpu:,.0f} ({row.mfu_percent:.1f}% MFU)</text>",
        ]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "benchmarks.svg")
    args = parser.parse_args(argv)
    if not args.table.is_file():
        raise SystemExit(f"no benchmark table at {args.table}")
    rows = read_results(args.table.read_text())
    args.output.write_text(render_svg(rows))
    print(f"{args.output}: {len(rows)} run(s)")


if __name__ == "__main__":
    main()
