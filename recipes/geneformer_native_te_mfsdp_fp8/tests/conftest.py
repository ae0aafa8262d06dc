"""Fixtures shared by the data tests: gene tokenizers and tiny Parquet files of cells written per test."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gene_tokenizer import build_gene_tokenizer


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
