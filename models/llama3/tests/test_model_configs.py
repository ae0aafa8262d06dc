"""The shipped model configs load, validate, and have the published shapes (built on the meta device)."""

import pytest
import torch
from llama_testing import MODEL_CONFIGS
from transformers import LlamaForCausalLM

from llama3_te.convert import hf_config_from_nv
from llama3_te.modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM


@pytest.mark.parametrize("name", ["llama3-tiny-nucleotide", "llama3.2-1b-nucleotide", "llama3.1-8b-nucleotide"])
def test_config_builds_with_the_same_parameter_count_as_hugging_face(name):
    config = NVLlamaConfig.from_pretrained(MODEL_CONFIGS / name, backend="torch")
    assert config.vocab_size == 256 and config.auto_map["AutoModelForCausalLM"].endswith("NVLlamaForCausalLM")
    with torch.device("meta"):
        nv_model = NVLlamaForCausalLM(config)
        hf_model = LlamaForCausalLM(hf_config_from_nv(config))
    count = sum(p.numel() for p in nv_model.parameters())  # parameters() lists a tied tensor once
    assert count == sum(p.numel() for p in hf_model.parameters())
    if name != "llama3-tiny-nucleotide":
        assert config.rope_parameters["rope_type"] == "llama3"
        # Meta's models minus the 128,256-token text embeddings (and LM head, for the untied 8B).
        expected_billions = {"llama3.2-1b-nucleotide": 0.97, "llama3.1-8b-nucleotide": 6.98}[name]
        assert abs(count / 1e9 - expected_billions) < 0.01, count
