"""scripts/evaluate_fasta_lm_loss.py on the checkpoints of a training run: the last DCP checkpoint scores as the export
does. The script against a hand-computed NLL, its windows and its input errors: tests/test_evaluate_fasta_lm_loss.py
(a copy of common/tests/)."""

import pytest
from launch import RECIPE_DIR
from modeling_llama_te import NVLlamaConfig
from test_evaluate_fasta_lm_loss import evaluate, fasta, main


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


def test_a_dcp_checkpoint_without_model_config_fails_clearly(l0_run, tmp_path, capsys):
    step_dir = tmp_path / "step_60"
    step_dir.symlink_to(l0_run / "checkpoints" / "step_60")
    assert main([str(step_dir), str(fasta(tmp_path)), "--device", "cpu"]) == 2
    assert "--model-config" in capsys.readouterr().err


def test_a_dcp_checkpoint_of_another_model_shape_is_refused(l0_run, tmp_path, capsys):
    """--model-config naming a model the checkpoint's weights do not fit fails with DCP's reason, not a traceback."""
    config = NVLlamaConfig.from_pretrained(l0_run / "checkpoints" / "model_config")
    config.num_hidden_layers += 1
    config.save_pretrained(tmp_path / "other_config")
    args = [str(l0_run / "checkpoints" / "step_60"), str(fasta(tmp_path)), "--device", "cpu"]
    assert main([*args, "--model-config", str(tmp_path / "other_config")]) == 2
    assert "does not match the model of" in capsys.readouterr().err
