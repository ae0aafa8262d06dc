"""ci/compare_losses.py: loss curves side by side, differences from the reference run, tolerance verdict, bad input."""

import json
import sys
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "ci"))
import compare_losses  # noqa: E402


def write_metrics(directory: Path, losses: dict[int, float]) -> Path:
    """A metrics.jsonl as the recipes' perf loggers write it (more keys than step and loss)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "metrics.jsonl"
    lines = [
        json.dumps({"step": step, "loss": loss, "grad_norm": 1.5, "lr": 1e-4, "tokens_per_second_per_gpu": 9e4})
        for step, loss in losses.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


PLAIN = {10: 3.2107, 20: 2.8621, 30: 2.8249}


def test_identical_runs_differ_by_zero_and_pass_any_tolerance(tmp_path, capsys):
    a = write_metrics(tmp_path / "plain", PLAIN)
    b = write_metrics(tmp_path / "again", PLAIN)
    assert compare_losses.main([str(a), f"copy={b}", "--tolerance", "0"]) == 0
    out = capsys.readouterr().out
    assert "copy vs plain: max |Δloss| 0, mean 0 over 3 logged steps  within the tolerance 0" in out


def test_difference_is_measured_at_each_step_and_judged_against_the_tolerance(tmp_path, capsys):
    a = write_metrics(tmp_path / "plain", PLAIN)
    b = write_metrics(tmp_path / "fast", {10: 3.2107, 20: 2.8721, 30: 2.8229})  # +0.01, -0.002
    assert compare_losses.main([f"plain={a}", f"fast={b}", "--tolerance", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "fast vs plain: max |Δloss| 0.01, mean 0.004 over 3 logged steps  within" in out
    assert "2.8721 (+0.0100)" in out and "2.8229 (-0.0020)" in out
    assert compare_losses.main([f"plain={a}", f"fast={b}", "--tolerance", "0.005"]) == 1
    assert "OUTSIDE the tolerance 0.005" in capsys.readouterr().out


def test_only_steps_every_run_logged_are_compared(tmp_path):
    reference = compare_losses.Run("plain", {10: 3.0, 20: 2.9, 30: 2.8, 40: 2.7})
    shorter = compare_losses.Run("short", {10: 3.0, 20: 3.0})  # stopped early
    other = compare_losses.Run("other", {20: 2.9, 30: 2.8, 40: 2.7})  # logged from step 20
    result = compare_losses.compare(reference, [shorter, other])
    assert result.steps == [20]
    assert result.max_abs_diff == {"short": pytest.approx(0.1), "other": 0.0}


def test_markdown_table_has_a_row_per_common_step(tmp_path, capsys):
    a = write_metrics(tmp_path / "plain", PLAIN)
    write_metrics(tmp_path / "recompute", PLAIN)
    compare_losses.main([str(a), str(tmp_path / "recompute"), "--markdown"])  # a folder means its metrics.jsonl
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| step | plain | recompute (Δ) |"
    assert lines[1] == "|---|---|---|"
    assert lines[2] == "| 10 | 3.2107 | 3.2107 (+0.0000) |"
    assert len([line for line in lines if line.startswith("| ")]) == 1 + len(PLAIN)


def test_a_resumed_run_keeps_the_later_line_for_a_repeated_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 10, "loss": 3.0}\n{"step": 20, "loss": 2.5}\n\n{"step": 20, "loss": 2.6}\n')
    assert compare_losses.read_metrics(path) == {10: 3.0, 20: 2.6}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"step": 10, "loss": 3.0}\nnot json\n', "metrics.jsonl:2: not a JSON line"),
        ('{"step": 10, "grad_norm": 3.0}\n', "metrics.jsonl:1: a metrics line needs 'step' and 'loss'"),
        ("\n", "no logged steps"),
    ],
)
def test_malformed_metrics_files_name_the_line(tmp_path, capsys, content, message):
    bad = tmp_path / "bad" / "metrics.jsonl"
    bad.parent.mkdir()
    bad.write_text(content)
    good = write_metrics(tmp_path / "plain", PLAIN)
    assert compare_losses.main([str(good), str(bad)]) == 2
    assert message in capsys.readouterr().err


def test_missing_files_and_disjoint_runs_are_errors(tmp_path, capsys):
    good = write_metrics(tmp_path / "plain", PLAIN)
    assert compare_losses.main([str(good), str(tmp_path / "nowhere" / "metrics.jsonl")]) == 2
    assert "no metrics file at" in capsys.readouterr().err
    later = write_metrics(tmp_path / "later", {100: 2.0})
    assert compare_losses.main([str(good), str(later)]) == 2
    assert "share no logged step" in capsys.readouterr().err


def test_runs_with_the_same_name_are_refused(tmp_path, capsys):
    """Two folders called run/ would be reported under one name: the user must name them."""
    first = write_metrics(tmp_path / "a" / "run", PLAIN)
    second = write_metrics(tmp_path / "b" / "run", {10: 9.0, 20: 9.0, 30: 9.0})
    assert compare_losses.main([str(first), str(second)]) == 2
    assert "two runs have the same name (run, run): name them with NAME=PATH" in capsys.readouterr().err
    assert compare_losses.main([f"plain={first}", f"other={second}"]) == 0


def test_one_run_alone_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        compare_losses.main([str(write_metrics(tmp_path / "plain", PLAIN))])
    assert exit_info.value.code == 2


def test_a_difference_that_rounds_to_zero_has_no_minus_sign():
    assert compare_losses._signed(-0.00001) == "+0.0000"
    assert compare_losses._signed(-0.00051) == "-0.0005"
