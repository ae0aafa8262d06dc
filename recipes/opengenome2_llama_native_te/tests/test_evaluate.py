"""scripts/evaluate_fasta_lm_loss.py against a negative log-likelihood computed by hand from the model's logits, on
an exported Hugging Face directory and on a DCP checkpoint of a training run, plus its errors."""

import json
import math
import sys

import pytest
import torch
from checkpoint import export_final_model
from launch import RECIPE_DIR
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from recipe_paths import recipe_path


sys.path.insert(0, str(RECIPE_DIR / "scripts"))
from evaluate_fasta_lm_loss import main, scoring_windows


SHORT = "ACGTNacgtRA"
LONG = "GATTACAnnnACGTGGCCTTAAGRYCATGCATGCAacgTT"  # 40 bases: 41 tokens with <bos>


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    config = NVLlamaConfig.from_pretrained(recipe_path("model_configs/llama3-tiny-nucleotide"), backend="torch")
    model = NVLlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("export") / "model"
    export_final_model(model, model.state_dict(), out, tokenizer)
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


def test_dcp_checkpoint_and_export_of_a_run_give_the_same_numbers(l0_run, tmp_path):
    """The training run's last DCP checkpoint (model config from checkpoints/model_config) and its final export."""
    eval_fasta = RECIPE_DIR / "data" / "sanity_eval.fasta"
    args = ["--window-length", "128", "--stride", "64"]
    dcp_report = evaluate(tmp_path / "dcp", l0_run / "checkpoints" / "step_60", eval_fasta, *args)
    hf_report = evaluate(tmp_path / "hf", l0_run / "final_model", eval_fasta, *args)
    assert dcp_report["num_sequences"] == 4
    for a, b in zip(dcp_report["sequences"], hf_report["sequences"]):
        assert a["mean_nll"] == pytest.approx(b["mean_nll"], rel=1e-6)
    assert dcp_report["token_weighted_nll"] < 1.0  # the trained model beats independent bases (ln 4 = 1.39)


@pytest.mark.parametrize("missing", ["checkpoint", "fasta"])
def test_missing_inputs_fail_clearly(tmp_path, export_dir, capsys, missing):
    checkpoint = tmp_path / "nope" if missing == "checkpoint" else export_dir
    fasta_path = tmp_path / "nope.fasta" if missing == "fasta" else fasta(tmp_path)
    assert main([str(checkpoint), str(fasta_path), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_dcp_checkpoint_without_model_config_fails_clearly(l0_run, tmp_path, capsys):
    step_dir = tmp_path / "step_60"
    step_dir.symlink_to(l0_run / "checkpoints" / "step_60")
    assert main([str(step_dir), str(fasta(tmp_path)), "--device", "cpu"]) == 2
    assert "--model-config" in capsys.readouterr().err
