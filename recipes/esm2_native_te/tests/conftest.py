"""Fixtures shared by several test modules of this recipe."""

import pytest
import torch
from transformers import EsmConfig, EsmForMaskedLM


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    """A tiny stock Hugging Face ESM-2 (``EsmForMaskedLM``, random weights) saved with ``save_pretrained``."""
    config = EsmConfig(
        vocab_size=33, mask_token_id=32, pad_token_id=1, position_embedding_type="rotary", token_dropout=True,
        emb_layer_norm_before=False, layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=1026, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
    )  # fmt: skip
    torch.manual_seed(3)
    model = EsmForMaskedLM(config)
    with torch.no_grad():
        model.lm_head.bias.normal_()  # zero at init: make it something a wrong load could not reproduce
    path = tmp_path_factory.mktemp("stock") / "esm2_tiny"
    model.save_pretrained(path)
    return path, model
