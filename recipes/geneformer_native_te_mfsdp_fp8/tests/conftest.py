"""Fixtures shared by several test modules: gene tokenizers, tiny Parquet files of cells written per test, and a
tiny stock checkpoint in the published Geneformer layout."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gene_tokenizer import build_gene_tokenizer
from transformers import BertConfig, BertForMaskedLM


@pytest.fixture(scope="session")
def tokenizer():
    """The default Geneformer V1 id vocabulary: <pad> = 0, <mask> = 1, genes 2..25425."""
    return build_gene_tokenizer(vocab_size=25_426)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """<pad>, <mask> and six genes (2..7): small enough that a random replacement hitting a special id would show."""
    return build_gene_tokenizer(vocab_size=8)


@pytest.fixture
def write_cells(tmp_path):
    """``write_cells(cells, name="cells.parquet", **columns)``: a Parquet file in ``tmp_path`` whose ``input_ids``
    column (list<int32>; None is a null cell) holds ``cells``, plus any further columns."""

    def write(cells, name: str = "cells.parquet", **columns) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"input_ids": pa.array(cells, pa.list_(pa.int32())), **columns}), path)
        return path

    return write


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    """A tiny stock Hugging Face ``BertForMaskedLM`` with Geneformer's settings (random weights), saved with
    ``save_pretrained``: the layout of the published Geneformer checkpoints."""
    config = BertConfig(
        vocab_size=25_426, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_act="relu", max_position_embeddings=512, layer_norm_eps=1e-12, hidden_dropout_prob=0.02,
        attention_probs_dropout_prob=0.02, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = BertForMaskedLM(config)
    with torch.no_grad():
        model.cls.predictions.bias.normal_()  # zero at init: make it something a wrong load could not reproduce
    path = tmp_path_factory.mktemp("stock") / "geneformer_tiny"
    model.save_pretrained(path)
    return path, model
