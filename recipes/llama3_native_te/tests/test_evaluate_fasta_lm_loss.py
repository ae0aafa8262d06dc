# Copied from common/tests/test_evaluate_fasta_lm_loss.py — edit the source, then run ci/check_copies.py --fix
"""scripts/evaluate_fasta_lm_loss.py on a tiny export against a negative log-likelihood computed by hand from the
model's logits, its scoring windows, and its errors for inputs it cannot score (the recipe's own tests score the
checkpoints of a training run)."""

import json
import math
import sys

import pytest
import torch
from checkpoint import COMPLETE_MARKER, export_final_model
from launch import RECIPE_DIR
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from recipe_paths import recipe_path
from transformers import AutoTokenizer


sys.path.insert(0, str(RECIPE_DIR / "scripts"))
from evaluate_fasta_lm_loss import main, scoring_windows


SHORT = "ACGTNacgtRA"
LONG = "GATTACAnnnACGTGGCCTTAAGRYCATGCATGCAacgTT"  # 40 bases: 41 tokens with <bos>


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = NVLlamaConfig.from_pretrained(recipe_path("model_configs/llama3-tiny-nucleotide"), backend="torch")
    model = NVLlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("export") / "model"
    export_final_model(model, model.state_dict(), out, AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer"))
    return out


def fasta(tmp_path):
    path = tmp_path / "eval.fasta"
    path.write_text(f">short first\n{SHORT}\n>long second\n{LONG[:25]}\n{LONG[25:]}\n")
    return path


def evaluate(report_dir, *args) -> dict:
    """Run the script's main() as the command line would and read the JSON it writes."""
    report_dir.mkdir(parents=True, exist_ok=True)
    output = report_dir / "report.json"
    assert main([str(a) for a in args] + ["--output", str(output), "--device", "cpu"]) == 0
    return json.loads(output.read_text())


def hand_nll(model, sequence: str, window: int, stride: int) -> tuple[float, int]:
    """Each position p >= 1 is scored in the first window whose end lies beyond it; windows end at window,
    window + stride, ... (the last at the sequence end) and reach `window` tokens back. Log-softmax by hand."""
    tokens = [1, *sequence.encode()]
    ends = list(range(window, len(tokens), stride)) + [len(tokens)]
    nll, count = 0.0, 0
    for p in range(1, len(tokens)):
        base = chr(tokens[p]).upper()
        if base not in "ACGT":
            continue
        end = next(e for e in ends if e > p)
        start = max(0, end - window)
        with torch.no_grad():
            logits = model(torch.tensor([tokens[start:end]])).logits[0, p - start - 1].double()
        nll -= (logits[ord(base)] - torch.logsumexp(logits, dim=0)).item()
        count += 1
    return nll, count


@pytest.mark.parametrize(("window", "stride"), [(16, 6), (64, 32)], ids=["sliding", "one_window"])
def test_nll_equals_hand_computed_log_softmax(tmp_path, export_dir, window, stride):
    model = NVLlamaForCausalLM.from_pretrained(
        export_dir, config=NVLlamaConfig.from_pretrained(export_dir, backend="torch")
    )
    report = evaluate(tmp_path, export_dir, fasta(tmp_path), "--window-length", window, "--stride", stride)
    totals = [0.0, 0]
    for result, sequence in zip(report["sequences"], [SHORT, LONG]):
        nll, count = hand_nll(model.eval(), sequence, window, stride)
        assert result["scored_bases"] == count == sum(b in "ACGTacgt" for b in sequence)
        assert result["mean_nll"] == pytest.approx(nll / count, rel=1e-5)
        assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
        totals = [totals[0] + nll, totals[1] + count]
    assert [r["id"] for r in report["sequences"]] == ["short", "long"]
    assert report["token_weighted_nll"] == pytest.approx(totals[0] / totals[1], rel=1e-5)


def test_scoring_windows_score_each_position_once():
    for length, window, stride in [(41, 16, 6), (16, 16, 8), (5, 16, 8), (100, 10, 10)]:
        scored = [p for _, end, first in scoring_windows(length, window, stride) for p in range(first, end)]
        assert scored == list(range(1, length))
        assert all(end - start <= window for start, end, _ in scoring_windows(length, window, stride))


@pytest.mark.parametrize("missing", ["checkpoint", "fasta"])
def test_missing_inputs_fail_clearly(tmp_path, export_dir, capsys, missing):
    checkpoint = tmp_path / "nope" if missing == "checkpoint" else export_dir
    fasta_path = tmp_path / "nope.fasta" if missing == "fasta" else fasta(tmp_path)
    assert main([str(checkpoint), str(fasta_path), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_checkpoint_still_being_written_is_refused(tmp_path, capsys):
    """A DCP directory without its COMPLETE marker (a save cut short) would be read half-written: refused."""
    step_dir = tmp_path / "checkpoints" / "step_10.tmp"
    step_dir.mkdir(parents=True)
    (step_dir / ".metadata").write_bytes(b"")
    assert main([str(step_dir), str(fasta(tmp_path)), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"no {COMPLETE_MARKER} marker" in err and "step_10.tmp" in err


def test_a_directory_that_is_no_checkpoint_fails_clearly(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(fasta(tmp_path)), "--device", "cpu"]) == 2
    assert "neither a Hugging Face directory" in capsys.readouterr().err
