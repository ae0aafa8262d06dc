"""What only Geneformer has, on the torch backend against the stock ``BertForMaskedLM`` (float32, CPU): token types,
positions that restart at every packed cell, the length limit, dropout in training, GELU, the LM head on labelled
genes only."""

import pytest
import torch
from geneformer_testing import make_batch, stock_model
from model_contract import pack

from geneformer_te.convert import convert_geneformer_hf_to_te


def test_token_type_ids_match_hugging_face_bshd_and_thd(hf_tiny):
    model = convert_geneformer_hf_to_te(hf_tiny, backend="torch").eval()
    batch = make_batch([30, 18, 7])
    token_types = (torch.arange(30) >= 10).long().expand(3, -1).clone()  # a second segment from position 10
    with torch.no_grad():
        expected = hf_tiny(**batch, token_type_ids=token_types)
        actual = model(**batch, token_type_ids=token_types)
        packed = pack(batch)
        real = batch["attention_mask"].bool()
        thd = model(**packed, token_type_ids=token_types[real].unsqueeze(0))
    assert (actual.logits[real] - expected.logits[real]).abs().max() < 1e-4
    assert abs(actual.loss.item() - expected.loss.item()) < 1e-5
    assert (thd.logits[0] - expected.logits[real]).abs().max() < 1e-4
    # The types do reach the model (a test that cannot fail otherwise proves nothing).
    with torch.no_grad():
        assert (model(**batch).logits[real] - actual.logits[real]).abs().max() > 1e-3


def test_packed_positions_restart_at_every_cell(hf_tiny):
    """The second packed cell gets positions 0.., as when HF sees it alone (not 30.., its offset in the pack)."""
    model = convert_geneformer_hf_to_te(hf_tiny, backend="torch").eval()
    batch = make_batch([30, 12], seed=5)
    with torch.no_grad():
        packed = model(**pack(batch)).logits[0, 30:]
        alone = hf_tiny(input_ids=batch["input_ids"][1:, :12]).logits[0]
    assert (packed - alone).abs().max() < 1e-4


def test_cells_longer_than_the_position_table_are_refused(hf_tiny):
    model = convert_geneformer_hf_to_te(hf_tiny, backend="torch")
    too_long = make_batch([257])  # max_position_embeddings 256
    with pytest.raises(ValueError, match="longer than max_position_embeddings .256."):
        model(**too_long)


def test_dropout_is_active_in_training_only():
    hf_model = stock_model(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = convert_geneformer_hf_to_te(hf_model, backend="torch")
    batch = make_batch([20, 11])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model(**batch).logits)
        expected = hf_model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (model(**batch).logits[real] - expected[real]).abs().max() < 1e-4
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(**batch).logits, model(**batch).logits)
