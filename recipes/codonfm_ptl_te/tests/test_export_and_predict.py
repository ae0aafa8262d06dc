"""The final export (loads with AutoModelForMaskedLM in a fresh process, holds the trained weights) and predict.py
(its pseudo-log-likelihoods equal a hand-written loop that masks one codon at a time; its embeddings are the mean of
the last hidden states). One short pre-training run (module fixture) provides the export and the checkpoint."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from launch import RECIPE_DIR, run_script
from modeling_codonfm_te import NVEncodonConfig, NVEncodonForMaskedLM
from sequences import MASK_ID, UNK_ID, encode


SEQUENCES = ["ATGAAACCCGGGTTTTAA", "ATGGCTGCAGCGGCCTAA", "ATGTGGTGA", "ATGCATCATCATCATCATCATTAG"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """20 steps of L0_sanity: a trained export and its last checkpoint."""
    run_dir = tmp_path_factory.mktemp("trained")
    run_script("train.py", f"output_dir={run_dir}", "num_train_steps=20", "trainer.val_check_interval=1000")
    return run_dir


def checkpoint_model(run_dir) -> NVEncodonForMaskedLM:
    """The weights of last.ckpt in a model built here from the checkpoint's own config, without the export path."""
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    config = NVEncodonConfig(**{**checkpoint["model_config"], "backend": "torch"})
    model = NVEncodonForMaskedLM(config)
    weights = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    # Checkpoints leave TE's FP8 bookkeeping (`_extra_state`) out; every weight must be there.
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(key.endswith("_extra_state") for key in missing), (missing, unexpected)
    return model.eval()


def batch() -> dict:
    ids = [torch.as_tensor(encode(s)) for s in SEQUENCES]
    input_ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=3)
    attention_mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(i) for i in ids], batch_first=True)
    input_ids[0, 2] = MASK_ID
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def test_export_loads_with_auto_model_in_a_fresh_process(trained, tmp_path):
    """A new Python process, outside the recipe (no recipe module on its path), loads final_model through
    AutoModelForMaskedLM with trust_remote_code and AutoTokenizer, and computes the logits of the checkpointed model."""
    export = trained / "final_model"
    config = json.loads((export / "config.json").read_text())
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_codonfm_te.NVEncodonForMaskedLM"
    assert config["backend"] == "auto" and config["layer_precision"] is None
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "logits.pt"
    torch.save(batch(), inputs)
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer
        config = AutoConfig.from_pretrained({str(export)!r}, trust_remote_code=True, backend="torch")
        model = AutoModelForMaskedLM.from_pretrained({str(export)!r}, config=config, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained({str(export)!r})
        assert tokenizer({SEQUENCES[0]!r})["input_ids"] == {encode(SEQUENCES[0]).tolist()!r}
        with torch.no_grad():
            torch.save(model(**torch.load({str(inputs)!r})).logits, {str(outputs)!r})
        print(type(model).__module__)
    """)
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transformers_modules" in result.stdout  # the class came from the export's own modeling file
    with torch.no_grad():
        expected = checkpoint_model(trained)(**batch()).logits
    torch.testing.assert_close(torch.load(outputs), expected, rtol=0, atol=0)


def hand_pll(model: NVEncodonForMaskedLM, sequence: str, positions: list[int] | None = None) -> float:
    """Mask one codon at a time (every one, or the token ``positions`` given), one padded forward pass per codon, and
    add up log p(true codon)."""
    ids = torch.as_tensor(encode(sequence)).unsqueeze(0)
    total = 0.0
    for position in positions or range(1, ids.shape[1] - 1):
        masked = ids.clone()
        masked[0, position] = MASK_ID
        with torch.no_grad():
            logits = model(input_ids=masked).logits[0, position].double()
        total += torch.log_softmax(logits, dim=-1)[ids[0, position]].item()
    return total


@pytest.mark.parametrize("source", ["final_model", "checkpoints/last.ckpt"])
def test_predict_writes_embeddings_and_plls_that_match_a_hand_loop(trained, tmp_path, source):
    path = tmp_path / "genes.parquet"
    pq.write_table(pa.table({"id": [f"g{i}" for i in range(len(SEQUENCES))], "sequence": SEQUENCES}), path)
    output = tmp_path / "out"
    # 3 sequences per batch and a token budget of 40: batches and packed forward passes both split sequences.
    run_script(
        "predict.py", f"model_path={trained / source}", f"data.predict_path={path}", f"output_dir={output}",
        "data.micro_batch_size=3", "pll_token_budget=40", "data.num_workers=0",
    )  # fmt: skip
    assert sorted(p.name for p in output.iterdir()) == ["embeddings.npy", "predictions.parquet"]
    table = pq.read_table(output / "predictions.parquet").to_pydict()
    assert table["id"] == ["g0", "g1", "g2", "g3"] and table["index"] == [0, 1, 2, 3]
    assert table["num_codons"] == [len(s) // 3 for s in SEQUENCES]

    model = checkpoint_model(trained)
    expected = [hand_pll(model, s) for s in SEQUENCES]
    np.testing.assert_allclose(table["pll"], expected, rtol=1e-5)
    np.testing.assert_allclose(table["mean_log_likelihood"], np.array(expected) / table["num_codons"], rtol=1e-5)

    embeddings = np.load(output / "embeddings.npy")
    assert embeddings.shape == (len(SEQUENCES), model.config.hidden_size) and embeddings.dtype == np.float32
    for row, sequence in enumerate(SEQUENCES):
        ids = torch.as_tensor(encode(sequence)).unsqueeze(0)
        with torch.no_grad():
            last = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        np.testing.assert_allclose(embeddings[row], last.mean(dim=0).numpy(), rtol=1e-5, atol=1e-6)


def test_unk_codons_are_context_never_scored_or_counted(trained, tmp_path):
    """Under invalid_codon_policy=unk an invalid codon (NNN) and a trailing partial codon become <UNK>, which training
    never predicts: the PLL is the hand loop's sum over the real codons only (the <UNK>s still in every masked copy),
    num_codons leaves them out, and a sequence of <UNK>s alone has no codon (PLL 0, mean NaN)."""
    sequences = ["ATGAAANNNGGGTTTTAA", "ATGGCTGCAGCGGCCTAAGC", "NNNNNN"]
    path = tmp_path / "genes.parquet"
    pq.write_table(pa.table({"id": ["mid", "tail", "none"], "sequence": sequences}), path)
    output = tmp_path / "out"
    run_script(
        "predict.py", f"model_path={trained / 'final_model'}", f"data.predict_path={path}", f"output_dir={output}",
        "data.invalid_codon_policy=unk", "pll_token_budget=40", "data.num_workers=0",
    )  # fmt: skip
    table = pq.read_table(output / "predictions.parquet").to_pydict()
    assert table["id"] == ["mid", "tail", "none"]
    known = [[1, 2, 4, 5, 6], [1, 2, 3, 4, 5, 6], []]  # token positions of the real codons (<CLS> is 0)
    for sequence, positions in zip(sequences, known):
        ids = encode(sequence)
        assert sorted(set(range(1, len(ids) - 1)) - set(positions)) == [i for i, t in enumerate(ids) if t == UNK_ID]
    assert table["num_codons"] == [5, 6, 0]

    model = checkpoint_model(trained)
    expected = [hand_pll(model, s, p) if p else 0.0 for s, p in zip(sequences, known)]
    np.testing.assert_allclose(table["pll"], expected, rtol=1e-5)
    np.testing.assert_allclose(table["mean_log_likelihood"][:2], [expected[0] / 5, expected[1] / 6], rtol=1e-5)
    assert np.isnan(table["mean_log_likelihood"][2])
    # Scoring the <UNK> too (as before) gives another number: the check above can fail.
    assert abs(hand_pll(model, sequences[0]) - expected[0]) > 1e-3


def test_predict_refuses_a_fine_tuned_classifier(tmp_path):
    """PLLs need the masked-LM head: a sequence-classification export is a user error in one line."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(RECIPE_DIR / "model_configs" / "encodon_80m")
    config.architectures = ["NVEncodonForSequenceClassification"]
    config.save_pretrained(tmp_path / "classifier")
    (tmp_path / "classifier" / "model.safetensors").write_bytes(b"")
    result = run_script(
        "predict.py", f"model_path={tmp_path / 'classifier'}", "data.predict_path=data/sanity_val.parquet",
        f"output_dir={tmp_path / 'out'}", expect_failure=True,
    )  # fmt: skip
    assert result.returncode == 2 and "masked-LM head" in result.stderr
