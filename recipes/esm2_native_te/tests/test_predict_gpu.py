"""predict.py on a GPU with TransformerEngine's layers: the predictions of the torch backend on the CPU, to the
rounding of the compute precision."""

import numpy as np
import pyarrow.parquet as pq
import pytest
from launch import run_script
from test_predict import SEQUENCES, make_export, write_sequences


@pytest.mark.requires_te
def test_te_on_a_gpu_predicts_what_torch_does_on_the_cpu(tmp_path):
    make_export(tmp_path / "export")
    data = write_sequences(tmp_path / "seqs.parquet", SEQUENCES, ids=[f"p{i}" for i in range(len(SEQUENCES))])
    common = [f"model_path={tmp_path / 'export'}", f"data.path={data}", "data.max_seq_length=64", "token_budget=64"]
    run_script("predict.py", *common, f"output_dir={tmp_path / 'cpu'}")  # torch backend, float32
    result = run_script("predict.py", *common, f"output_dir={tmp_path / 'gpu'}", cpu_only=False)
    assert "te backend, torch.bfloat16 on cuda" in result.stdout  # auto: TE's layers in bf16
    cpu, gpu = (pq.read_table(tmp_path / name / "predictions.parquet").to_pydict() for name in ("cpu", "gpu"))
    assert gpu["id"] == cpu["id"] and gpu["num_residues"] == cpu["num_residues"]
    exact, rounded = (np.load(tmp_path / name / "embeddings.npy") for name in ("cpu", "gpu"))
    cosine = (exact * rounded).sum(1) / np.linalg.norm(exact, axis=1) / np.linalg.norm(rounded, axis=1)
    assert cosine.min() > 0.999
    np.testing.assert_allclose(gpu["mean_log_likelihood"], cpu["mean_log_likelihood"], atol=0.05)
