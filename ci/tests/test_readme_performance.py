"""The README's Performance table quotes docs/benchmarks.md: every tokens/s with its MFU in the H100 and H200 columns is
a row of the results table on that GPU, and the commit the cell names appears in that row."""

import re
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
NUMBER_WITH_MFU = re.compile(r"(\d{1,3}(?:,\d{3})+) \((\d+\.\d)%")  # "119,962 (50.2%" or "88,175 (79.4%, ..."
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")


def performance_rows() -> list[list[str]]:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance") : readme.index("\n## ", readme.index("## Performance") + 1)]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header, *rows = ([cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines)
    assert header[2:4] == ["1×H100", "1×H200"], header
    return rows


def results_rows() -> list[list[str]]:
    text = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if re.match(r"^\| 20\d\d-\d\d-\d\d \|", line)
    ]


def test_every_quoted_number_is_a_recorded_row_of_that_gpu_and_commit():
    rows, results = performance_rows(), results_rows()
    quoted = 0
    for row in rows:
        for column, gpu in ((2, "H100"), (3, "H200")):
            cell = row[column]
            commits = COMMIT.findall(cell)
            for tokens, mfu in NUMBER_WITH_MFU.findall(cell):
                assert commits, f"{row[0]} on {gpu}: {tokens} names no commit"
                matches = [
                    result
                    for result in results
                    if gpu in result[1]
                    and result[8] == tokens
                    and result[10] == f"{mfu}%"
                    and commits[-1] in result[12]
                ]
                assert matches, (
                    f"{row[0]} on {gpu}: no row of docs/benchmarks.md has {tokens} tokens/s at {mfu}% MFU and {commits[-1]}"
                )
                quoted += 1
    assert quoted >= 25  # the table was parsed: an empty match would pass vacuously
