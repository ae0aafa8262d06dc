"""Fixtures for the Llama 3 model tests."""

import pytest
import torch
from llama_testing import LLAMA3_ROPE, TINY_GQA_SHAPE, hf_llama_config, randomize_
from transformers import LlamaForCausalLM


@pytest.fixture
def hf_tiny() -> LlamaForCausalLM:
    """GQA (4 query heads, 2 key/value heads) with Llama 3 rope scaling: the shape most likely to break a mapping."""
    torch.manual_seed(0)
    return randomize_(LlamaForCausalLM(hf_llama_config(LLAMA3_ROPE, **TINY_GQA_SHAPE))).eval()
