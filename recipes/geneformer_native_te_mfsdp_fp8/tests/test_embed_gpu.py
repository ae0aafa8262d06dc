"""embed.py on a GPU with TransformerEngine's layers: the embeddings of the torch backend on the CPU, to the rounding
of the compute precision, for an export and for a published-layout checkpoint (converted into TE's layers)."""

import numpy as np
import pyarrow.parquet as pq
import pytest
from convert import convert_geneformer_hf_to_te
from gene_tokenizer import build_gene_tokenizer
from hf_export import write_hf_directory
from launch import run_script
from test_embed import FIRST, SECOND


@pytest.mark.requires_te
@pytest.mark.parametrize("source", ["export", "published"])
def test_te_on_a_gpu_embeds_what_torch_does_on_the_cpu(tmp_path, stock_checkpoint, write_cells, source):
    path, hf_model = stock_checkpoint
    if source == "export":
        path = tmp_path / "export"
        tokenizer = build_gene_tokenizer()
        write_hf_directory(convert_geneformer_hf_to_te(hf_model, backend="torch"), path, tokenizer=tokenizer)
    data = write_cells(FIRST + SECOND)
    common = [f"model_path={path}", f"dataset.path={data}", "dataset.max_seq_length=48", "token_budget=64"]
    run_script("embed.py", *common, f"output_dir={tmp_path / 'cpu'}")  # torch backend, float32
    result = run_script("embed.py", *common, f"output_dir={tmp_path / 'gpu'}", cpu_only=False)
    assert "te backend, torch.bfloat16 on cuda" in result.stdout  # auto: TE's layers in bf16
    cpu, gpu = (pq.read_table(tmp_path / name / "cells.parquet").to_pydict() for name in ("cpu", "gpu"))
    assert gpu == cpu and gpu["index"] == [0, 1, 3, 4, 5]
    exact, rounded = (np.load(tmp_path / name / "embeddings.npy") for name in ("cpu", "gpu"))
    cosine = (exact * rounded).sum(1) / np.linalg.norm(exact, axis=1) / np.linalg.norm(rounded, axis=1)
    assert cosine.min() > 0.999
