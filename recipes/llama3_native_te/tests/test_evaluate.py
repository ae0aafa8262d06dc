"""scripts/evaluate_fasta_lm_loss.py on the checkpoints of a DDP training run: its last checkpoint (``train_state.pt``,
the model config from ``checkpoints/model_config``) scores as its export does, and learned something. The script
against a hand-computed NLL, its windows and its input errors: tests/test_evaluate_fasta_lm_loss.py (a copy of
common/tests/)."""

from pathlib import Path

import pytest
from launch import RECIPE_DIR, run_script
from modeling_llama_te import NVLlamaConfig
from test_evaluate_fasta_lm_loss import evaluate, fasta, main


EVAL_FASTA = RECIPE_DIR / "data" / "sanity_dna_valid.fasta"
WINDOWS = ["--window-length", "128", "--stride", "64"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """One process, 40 steps of L0_sanity with windows of 128 tokens: a checkpoint at step 40 and an export."""
    output_dir = tmp_path_factory.mktemp("ddp_run")
    run_script(
        "train_ddp.py",
        f"output_dir={output_dir}",
        "num_train_steps=40",
        "dataset.max_seq_length=128",
        "dataset.window_overlap=0",
        "adamw_kwargs.lr=5e-3",
        "lr_scheduler_kwargs.num_decay_steps=40",
    )
    return output_dir


def test_ddp_checkpoint_and_export_of_a_run_give_the_same_numbers(ddp_run, tmp_path):
    assert (ddp_run / "checkpoints" / "step_40" / "train_state.pt").is_file()
    ddp_report = evaluate(tmp_path / "ddp", ddp_run / "checkpoints" / "step_40", EVAL_FASTA, *WINDOWS)
    hf_report = evaluate(tmp_path / "hf", ddp_run / "final_model", EVAL_FASTA, *WINDOWS)
    assert ddp_report["num_sequences"] == hf_report["num_sequences"] > 1
    for a, b in zip(ddp_report["sequences"], hf_report["sequences"]):
        assert a["id"] == b["id"] and a["scored_bases"] == b["scored_bases"] > 0
        assert a["mean_nll"] == pytest.approx(b["mean_nll"], rel=1e-6)
    assert ddp_report["token_weighted_nll"] < 1.2  # the trained model beats independent bases (ln 4 = 1.39)


def test_a_checkpoint_of_another_model_shape_is_refused(ddp_run, tmp_path, capsys):
    """--model-config naming a model the checkpoint's weights do not fit fails with the keys, not a traceback."""
    config = NVLlamaConfig.from_pretrained(ddp_run / "checkpoints" / "model_config")
    config.num_hidden_layers += 1
    config.save_pretrained(tmp_path / "other_config")
    args = [str(ddp_run / "checkpoints" / "step_40"), str(fasta(tmp_path)), "--device", "cpu"]
    assert main([*args, "--model-config", str(tmp_path / "other_config")]) == 2
    err = capsys.readouterr().err
    assert "does not match the model of" in err and "layers.2." in err
