"""``python -m geneformer_te.export`` as a user runs it: a stock BertForMaskedLM directory in, an export out, with the
published-style gene dictionary so the exported tokenizer reads Ensembl ids."""

import json
import os
import subprocess
import sys

import pytest
import torch
from geneformer_testing import COMPONENT_DIR, VOCAB_SIZE, stock_model
from transformers import AutoModelForMaskedLM, AutoTokenizer


def test_export_cli_with_a_gene_dictionary(tmp_path):
    hf_model = stock_model()
    hf_model.save_pretrained(tmp_path / "stock")
    genes = {"<pad>": 0, "<mask>": 1, **{f"ENSG{i:011d}": i for i in range(2, VOCAB_SIZE)}}
    (tmp_path / "token_dictionary.json").write_text(json.dumps(genes))
    env = {**os.environ, "PYTHONPATH": str(COMPONENT_DIR), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "geneformer_te.export", "--source", str(tmp_path / "stock")]
    command += [
        "--output-dir",
        str(tmp_path / "out"),
        "--gene-token-dictionary",
        str(tmp_path / "token_dictionary.json"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {tmp_path / 'out'}" in result.stdout

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = tokenizer(["ENSG00000000007 ENSG00000000042 <mask>", "ENSG00000000999"], return_tensors="pt", padding=True)
    assert batch["input_ids"].tolist() == [[7, 42, 1], [999, 0, 0]]
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "out", trust_remote_code=True, backend="torch").eval()
    with torch.no_grad():
        actual, expected = model(**batch).logits, hf_model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (actual[real] - expected[real]).abs().max() < 1e-4
    assert "ENSG00000000002" in (tmp_path / "out" / "README.md").read_text()  # the card's example uses real tokens


def test_export_refuses_a_tokenizer_of_another_size(tmp_path):
    from geneformer_te.export import export_hf_checkpoint

    stock_model().save_pretrained(tmp_path / "stock")
    (tmp_path / "small.json").write_text(json.dumps({"<pad>": 0, "<mask>": 1, "ENSG1": 2}))
    with pytest.raises(ValueError, match="the tokenizer has 3 tokens, the model 1000"):
        export_hf_checkpoint(tmp_path / "stock", tmp_path / "out", gene_token_dictionary=tmp_path / "small.json")
    assert not (tmp_path / "out").exists()
