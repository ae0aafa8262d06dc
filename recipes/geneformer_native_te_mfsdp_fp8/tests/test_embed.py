"""embed.py: cell embeddings equal a stock Hugging Face BertModel's hidden states averaged one cell at a time, for a
published-layout checkpoint and an export of this recipe, in one process and split over two; input rows,
truncation, skipped empty cells and kept columns; and the errors a user can make."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from convert import convert_geneformer_hf_to_te
from gene_tokenizer import build_gene_tokenizer
from hf_export import write_hf_directory
from launch import run_in_process, run_script


# Two files; the third cell is empty (skipped), the fifth is longer than MAX_GENES (truncated to its first genes).
FIRST = [[5, 9, 200, 31, 7], [100 + i for i in range(40)], []]
SECOND = [[3, 4], list(range(2, 70)), [25_000, 12, 600]]
MAX_GENES = 48


@pytest.fixture
def cell_files(write_cells):
    first = write_cells(FIRST, "cells/a.parquet", cell_type=["t", "b", "none"])
    write_cells(SECOND, "cells/b.parquet", cell_type=["t", "nk", "b"])
    return first.parent


def expected_embeddings(hf_model, cells, hidden_layer: int) -> np.ndarray:
    """The reference: the stock model's forward on each cell alone (no padding), its hidden states averaged."""
    rows = []
    hf_model.eval()  # the fixture's model was built in training mode: dropout on
    with torch.no_grad():
        for cell in cells:
            out = hf_model.bert(input_ids=torch.tensor(cell[:MAX_GENES])[None], output_hidden_states=True)
            rows.append(out.hidden_states[hidden_layer][0].mean(0).numpy())
    return np.stack(rows)


def embed(out_dir, model_path, data, *args, nproc=None):
    common = [f"model_path={model_path}", f"dataset.path={data}", f"dataset.max_seq_length={MAX_GENES}"]
    run_script("embed.py", *common, f"output_dir={out_dir}", "token_budget=64", *args, nproc=nproc)
    return pq.read_table(out_dir / "cells.parquet").to_pydict(), np.load(out_dir / "embeddings.npy")


def test_a_published_checkpoint_embeds_every_cell_as_bert_does_alone(tmp_path, stock_checkpoint, cell_files):
    path, hf_model = stock_checkpoint
    table, embeddings = embed(tmp_path / "out", path, cell_files, "dataset.keep_columns=[cell_type]")
    # Rows 0, 1, 3, 4, 5 over both files: the empty cell (row 2) is skipped; the long one keeps MAX_GENES genes.
    assert table["index"] == [0, 1, 3, 4, 5]
    assert [name.rsplit("/", 1)[-1] for name in table["file"]] == ["a.parquet"] * 2 + ["b.parquet"] * 3
    assert table["row"] == [0, 1, 0, 1, 2]
    assert table["num_genes"] == [5, 40, 2, MAX_GENES, 3]
    assert table["cell_type"] == ["t", "b", "t", "nk", "b"]
    cells = [FIRST[0], FIRST[1], *SECOND]
    np.testing.assert_allclose(embeddings, expected_embeddings(hf_model, cells, -2), atol=1e-5, rtol=1e-4)
    assert not np.allclose(embeddings, expected_embeddings(hf_model, cells, -1), atol=1e-3)  # the layer matters
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cells.parquet", "embeddings.npy"]


def test_an_export_over_two_processes_equals_one_process_and_bert(tmp_path, stock_checkpoint, cell_files):
    path, hf_model = stock_checkpoint
    export = tmp_path / "export"
    write_hf_directory(
        convert_geneformer_hf_to_te(hf_model, backend="torch"), export, tokenizer=build_gene_tokenizer()
    )
    one_table, one = embed(tmp_path / "one", export, cell_files, "hidden_layer=-1")
    two_table, two = embed(tmp_path / "two", export, cell_files, "hidden_layer=-1", nproc=2)
    assert two_table == one_table and one_table["index"] == [0, 1, 3, 4, 5]
    np.testing.assert_allclose(two, one, atol=1e-6)
    cells = [FIRST[0], FIRST[1], *SECOND]
    np.testing.assert_allclose(one, expected_embeddings(hf_model, cells, -1), atol=1e-5, rtol=1e-4)


def test_a_layer_counted_from_the_start_is_that_hidden_state(tmp_path, stock_checkpoint, cell_files):
    path, hf_model = stock_checkpoint
    _, embeddings = embed(tmp_path / "out", path, cell_files, "hidden_layer=0")  # the embedding layer's output
    cells = [FIRST[0], FIRST[1], *SECOND]
    np.testing.assert_allclose(embeddings, expected_embeddings(hf_model, cells, 0), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("hidden_layer=3", "hidden_layer=3: the model has 2 layers, so hidden states 0..2"),
        ("token_budget=16", "token_budget=16 is below the 48 genes a cell may keep"),
        ("dataset.max_seq_length=1000", "dataset.max_seq_length=1000: the model embeds positions 1..512"),
        ("dataset.keep_columns=[donor]", "no column 'donor' to keep"),
        ("dataset.input_ids_column=genes", "no column 'genes'; columns are"),
        ("dtype=float16", "dtype=float16: choose auto, float32 or bfloat16"),
        ("dataset.empty_cell_policy=error", "an empty cell (1 in the file)"),
        ("hiden_layer=1", "did you mean hidden_layer? hydra_config/embed.yaml lists every key"),
    ],
)
def test_user_errors_name_the_key_and_write_nothing(tmp_path, stock_checkpoint, cell_files, override, message):
    path, _ = stock_checkpoint
    budget = [] if override.startswith("token_budget") else ["token_budget=64"]
    args = [f"model_path={path}", f"dataset.path={cell_files}", f"dataset.max_seq_length={MAX_GENES}", *budget]
    result = run_in_process("embed.py", *args, f"output_dir={tmp_path / 'out'}", override, expect_failure=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_model_path_that_is_not_geneformer_is_named(tmp_path, cell_files):
    other = tmp_path / "esm"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "esm"}')
    (other / "model.safetensors").write_bytes(b"")
    args = [f"model_path={other}", f"dataset.path={cell_files}", f"output_dir={tmp_path / 'out'}"]
    result = run_in_process("embed.py", *args, expect_failure=True)
    assert result.returncode == 2 and "model_path" in result.stderr and "not Geneformer" in result.stderr
