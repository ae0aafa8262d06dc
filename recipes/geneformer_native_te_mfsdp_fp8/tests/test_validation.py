"""Held-out masked-gene validation (validation.py + dataset.held_out_batches) against a loss computed by hand.

The reference runs every held-out cell alone through a tiny torch-backend Geneformer, truncated to max_seq_length and
masked as the training masker masks it from ``(seed, epoch 0, row)``, and takes the log-softmax by hand; the recipe's
packed or padded batches, split over ranks, scored with the MLM head on the masked genes only (as the entrypoints run
it), must give the same token-weighted loss.
"""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from collator import MLMMasker
from dataset import gene_token_ids, held_out_batches
from gene_tokenizer import build_gene_tokenizer
from grad_accumulation import count_targets
from modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM
from omegaconf import OmegaConf
from user_errors import ConfigError
from validation import Validator


SEED = 7
VOCAB_SIZE = 64  # <pad> = 0, <mask> = 1, genes 2..63
MAX_SEQ_LENGTH = 24
DATA_CFG = {"path": "unused", "max_seq_length": MAX_SEQ_LENGTH, "micro_batch_size": 3, "token_budget": 48}


def make_cells() -> list[list[int]]:
    """Eleven cells of 6 to 20 distinct genes, an empty one (skipped, as in training) and one of 40 genes (truncated
    to its first MAX_SEQ_LENGTH, as in training)."""
    rng = np.random.default_rng(0)
    cells = [rng.choice(np.arange(2, VOCAB_SIZE), size=n, replace=False).tolist() for n in rng.integers(6, 21, 11)]
    cells.insert(3, [])
    cells.append(rng.choice(np.arange(2, VOCAB_SIZE), size=40, replace=False).tolist())
    return cells


@pytest.fixture(scope="module")
def gene_tokenizer():
    return build_gene_tokenizer(vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = NVGeneformerConfig(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        backend="torch",
    )
    return NVGeneformerForMaskedLM(config).eval()


@pytest.fixture
def held_out_file(tmp_path):
    path = tmp_path / "held_out.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(make_cells(), pa.list_(pa.int32()))}), path)
    return str(path)


def validator(
    path, tokenizer, output_dir, input_format="thd", dp_rank=0, dp_world_size=1, labeled_logits_only=True, **val
) -> Validator:
    """The entrypoints' Validator: the MLM head on the masked genes only (``labeled_logits_only``), as in training."""
    cfg = OmegaConf.create({"path": path, "every_n_steps": 5, "max_batches": None, **val})
    data_cfg = {**DATA_CFG, "input_format": input_format}
    return Validator(
        cfg,
        lambda p: held_out_batches(p, data_cfg, tokenizer, dp_rank, dp_world_size, SEED),
        dp_rank=dp_rank,
        device=torch.device("cpu"),
        output_dir=output_dir,
        forward_kwargs={"labeled_logits_only": labeled_logits_only},
    )


def hand_computed_loss(model, tokenizer, path) -> tuple[float, int]:
    """Each non-empty cell alone ([1, L], no padding), its first MAX_SEQ_LENGTH genes masked from (SEED, 0, row),
    scored by a hand log-softmax over every position's logits."""
    masker = MLMMasker.from_tokenizer(
        tokenizer, seed=SEED, mlm_probability=0.15, random_token_ids=gene_token_ids(tokenizer)
    )
    nll, count = 0.0, 0
    for row, cell in enumerate(pq.read_table(path).column("input_ids").to_pylist()):
        if not cell:
            continue
        masked, labels = masker(np.asarray(cell[:MAX_SEQ_LENGTH], dtype=np.int64), 0, row)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(masked)[None]).logits[0].double()
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        for position in np.flatnonzero(labels != -100):
            nll -= log_probs[position, labels[position]].item()
            count += 1
    return nll / count, count


@pytest.mark.parametrize("input_format", ["thd", "bshd"])
def test_validation_loss_equals_a_hand_computed_one(model, gene_tokenizer, held_out_file, tmp_path, input_format):
    expected, count = hand_computed_loss(model, gene_tokenizer, held_out_file)
    val = validator(held_out_file, gene_tokenizer, tmp_path, input_format)
    metrics = val.run(model, step=5)
    assert metrics["val_tokens"] == count > 0
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert json.loads((tmp_path / "validation.jsonl").read_text()) == metrics
    # The same masks at every evaluation: the curve shows the model changing, not the sample.
    assert val.run(model, step=10) == {**metrics, "step": 10}
    # The full MLM head gives the same loss as the head on the masked genes only.
    full_head = validator(held_out_file, gene_tokenizer, tmp_path / "full", input_format, labeled_logits_only=False)
    assert full_head.run(model, step=15)["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert not model.training  # the pass leaves the model in the mode it found it in (dropout off, here)
    model.train()
    try:
        assert val.run(model, step=20)["val_loss"] == metrics["val_loss"]  # dropout off in it
        assert model.training  # and a training loop's model keeps training
    finally:
        model.eval()


def test_two_ranks_score_every_cell_once_and_together_give_the_one_reader_loss(
    model, gene_tokenizer, held_out_file, tmp_path
):
    whole = validator(held_out_file, gene_tokenizer, tmp_path / "whole").run(model, step=1)
    parts = [
        validator(held_out_file, gene_tokenizer, tmp_path / f"r{r}", "thd", r, 2).run(model, step=1) for r in (0, 1)
    ]
    assert sum(p["val_tokens"] for p in parts) == whole["val_tokens"]
    combined = sum(p["val_loss"] * p["val_tokens"] for p in parts) / whole["val_tokens"]
    assert combined == pytest.approx(whole["val_loss"], rel=1e-6)
    # Rank r scores the usable cells r, r + 2, ... in file order (masked as one reader masks them): every one, once.
    masker = MLMMasker.from_tokenizer(
        gene_tokenizer, seed=SEED, mlm_probability=0.15, random_token_ids=gene_token_ids(gene_tokenizer)
    )
    cells = make_cells()
    usable = [row for row, cell in enumerate(cells) if cell]
    for rank in (0, 1):
        batches = held_out_batches(held_out_file, DATA_CFG, gene_tokenizer, rank, 2, SEED).read()
        scored = torch.cat([b["labels"][b["labels"] != -100] for b in batches]).tolist()
        expected = [masker(np.array(cells[row][:MAX_SEQ_LENGTH]), 0, row)[1] for row in usable[rank::2]]
        assert scored == [int(label) for labels in expected for label in labels if label != -100]


def test_the_placeholder_scores_nothing_and_max_batches_bounds_the_pass(
    model, gene_tokenizer, held_out_file, tmp_path
):
    for input_format in ("thd", "bshd"):
        data_cfg = {**DATA_CFG, "input_format": input_format, "pad_to_multiple_of": 8}
        data = held_out_batches(held_out_file, data_cfg, gene_tokenizer, seed=SEED)
        assert count_targets(data.placeholder, causal_lm=False) == 0
        assert data.placeholder["input_ids"].numel() == 8  # one gene, padded as the batches are
        with torch.no_grad():  # runs as a batch does, with nothing to score
            assert model(**data.placeholder, labeled_logits_only=True).loss.item() == 0.0
    batches = list(
        held_out_batches(held_out_file, {**DATA_CFG, "input_format": "bshd"}, gene_tokenizer, seed=SEED).read()
    )
    first = validator(held_out_file, gene_tokenizer, tmp_path, "bshd", max_batches=1).run(model, step=1)
    assert len(batches) == 4 and first["val_tokens"] == count_targets(batches[0], causal_lm=False)


def test_a_rank_without_cells_runs_the_placeholder(model, gene_tokenizer, tmp_path, write_cells):
    """Two usable cells over three ranks: rank 2 has none and runs the placeholder, scoring nothing."""
    path = write_cells([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
    data = held_out_batches(path, {**DATA_CFG, "input_format": "thd"}, gene_tokenizer, 2, 3, SEED)
    assert list(data.read()) == [] and "scores 0 of them in 0 batch(es)" in data.description


def test_bad_held_out_data_fails_when_the_validator_is_built(gene_tokenizer, tmp_path, write_cells):
    with pytest.raises(FileNotFoundError, match="matches no Parquet file; point validation.path at"):
        validator(str(tmp_path / "missing.parquet"), gene_tokenizer, tmp_path)
    outside = write_cells([[5, 6, 7], [8, 300, 9]], name="outside.parquet")
    with pytest.raises(ConfigError, match=r"outside.parquet row 1.*gene token id 300 is outside the vocabulary"):
        validator(str(outside), gene_tokenizer, tmp_path)
    empty = write_cells([[], None], name="empty.parquet")
    with pytest.raises(ConfigError, match="no usable cell.*check validation.path"):
        validator(str(empty), gene_tokenizer, tmp_path)
    with pytest.raises(ConfigError, match="every_n_steps must be >= 1"):
        validator(str(outside), gene_tokenizer, tmp_path, every_n_steps=0)


def test_no_path_means_never(tmp_path):
    cfg = OmegaConf.create({"path": None, "every_n_steps": 0, "max_batches": None})
    val = Validator(cfg, None, dp_rank=0, device=torch.device("cpu"), output_dir=tmp_path)
    assert not val.enabled and not any(val.due(step) for step in range(1, 100))
