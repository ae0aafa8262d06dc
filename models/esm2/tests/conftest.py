"""Fixtures for the ESM-2 model tests."""

import pytest
import torch
from esm_testing import TINY_SHAPE, hf_esm2_config, randomize_
from transformers import EsmForMaskedLM


@pytest.fixture
def hf_tiny() -> EsmForMaskedLM:
    torch.manual_seed(0)
    return randomize_(EsmForMaskedLM(hf_esm2_config(**TINY_SHAPE))).eval()
