"""Fixtures for the Geneformer model tests."""

import pytest
from geneformer_testing import stock_model
from transformers import BertForMaskedLM


@pytest.fixture
def hf_tiny() -> BertForMaskedLM:
    return stock_model()
