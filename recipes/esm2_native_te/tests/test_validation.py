"""Held-out masked-LM validation (validation.py + validation_data.py) against a loss computed by hand.

The reference runs every held-out sequence alone through the model, with the mask that ``MLMMasker`` draws for it
from ``(seed, row)``, and takes the log-softmax by hand; the recipe's packed or padded batches, split over ranks or
context-parallel ranks, must give the same token-weighted loss.
"""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from collator import MLMMasker
from grad_accumulation import count_targets
from launch import RECIPE_DIR
from modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from user_errors import ConfigError
from validation import Validator
from validation_data import held_out_batches


SEED = 7
SEQUENCES = [
    "MKTAYIAKQRQISFVKSHFSRQ",
    "GSHMLEDPVDAFQ",
    "mktayiak qrqis",  # lowercase and whitespace are cleaned as in training
    "",  # empty: skipped, as in training
    "ACDEFGHIKLMNPQRSTVWY" * 4,  # 80 residues > max_seq_length - 2: cropped to a window seeded by (seed, row)
    "MPEPTIDESEQ",
    "WWWKKKLLL",
]
DATA_CFG = {"path": "unused", "max_seq_length": 40, "micro_batch_size": 3, "token_budget": 64, "num_proc": None}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = NVEsmConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, backend="torch"
    )
    return NVEsmForMaskedLM(config).eval()


@pytest.fixture
def held_out_file(tmp_path):
    path = tmp_path / "held_out.parquet"
    pq.write_table(pa.table({"sequence": SEQUENCES}), path)
    return str(path)


def validator(path, tokenizer, output_dir, input_format="thd", dp_rank=0, dp_world_size=1, **val) -> Validator:
    cfg = OmegaConf.create({"path": path, "every_n_steps": 5, "max_batches": None, **val})
    data_cfg = {**DATA_CFG, "input_format": input_format}
    return Validator(
        cfg,
        lambda p: held_out_batches(p, data_cfg, tokenizer, dp_rank, dp_world_size, SEED),
        dp_rank=dp_rank,
        device=torch.device("cpu"),
        output_dir=output_dir,
    )


def hand_computed_loss(model, tokenizer, path) -> tuple[float, int]:
    """Each usable row alone ([1, L], no padding), masked from (SEED, epoch 0, row), scored by a hand log-softmax."""
    from dataset import SequencePolicy, residue_token_ids

    policy = SequencePolicy.from_tokenizer(tokenizer, max_seq_length=DATA_CFG["max_seq_length"])
    masker = MLMMasker.from_tokenizer(
        tokenizer, seed=SEED, mlm_probability=0.15, random_token_ids=residue_token_ids(tokenizer)
    )
    nll, count = 0.0, 0
    for row, raw in enumerate(pq.read_table(path).column("sequence").to_pylist()):
        text, skip, _, _ = policy.clean(raw, (SEED, row), "test")
        if skip:
            continue
        ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)
        masked, labels = masker(ids, 0, row)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(masked)[None]).logits[0].double()
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        for position in np.flatnonzero(labels != -100):
            nll -= log_probs[position, labels[position]].item()
            count += 1
    return nll / count, count


@pytest.mark.parametrize("input_format", ["thd", "bshd"])
def test_validation_loss_equals_a_hand_computed_one(model, tokenizer, held_out_file, tmp_path, input_format):
    expected, count = hand_computed_loss(model, tokenizer, held_out_file)
    val = validator(held_out_file, tokenizer, tmp_path, input_format)
    metrics = val.run(model, step=5)
    assert metrics["val_tokens"] == count > 0
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert json.loads((tmp_path / "validation.jsonl").read_text()) == metrics
    # The same masks at every evaluation: the curve shows the model changing, not the sample.
    assert val.run(model, step=10) == {**metrics, "step": 10}


def test_two_ranks_score_every_row_once_and_together_give_the_one_reader_loss(
    model, tokenizer, held_out_file, tmp_path
):
    whole = validator(held_out_file, tokenizer, tmp_path / "whole").run(model, step=1)
    parts = [validator(held_out_file, tokenizer, tmp_path / f"r{r}", "thd", r, 2).run(model, step=1) for r in (0, 1)]
    assert sum(p["val_tokens"] for p in parts) == whole["val_tokens"]
    combined = sum(p["val_loss"] * p["val_tokens"] for p in parts) / whole["val_tokens"]
    assert combined == pytest.approx(whole["val_loss"], rel=1e-6)


def test_context_parallel_batches_score_the_same_tokens(tokenizer, held_out_file):
    plain = held_out_batches(held_out_file, {**DATA_CFG, "input_format": "thd"}, tokenizer, seed=SEED)
    split = held_out_batches(held_out_file, {**DATA_CFG, "input_format": "thd"}, tokenizer, seed=SEED, cp_size=2)
    plain_batches, split_batches = list(plain.read()), list(split.read())
    # Padding each sequence to a multiple of 2 * cp_size may pack the rows differently, not mask them differently.
    assert sum(count_targets(b, causal_lm=False) for b in plain_batches) == sum(
        count_targets(b, causal_lm=False) for b in split_batches
    )

    def scored_labels(batches):  # in row order: the rows keep their file order however they are packed
        return torch.cat([b["labels"][b["labels"] != -100] for b in batches])

    assert torch.equal(scored_labels(split_batches), scored_labels(plain_batches))
    assert all(torch.all(torch.diff(b["cu_seq_lens_q"]) % 4 == 0) for b in split_batches)


def test_the_placeholder_scores_nothing_and_max_batches_bounds_the_pass(model, tokenizer, held_out_file, tmp_path):
    data = held_out_batches(held_out_file, {**DATA_CFG, "input_format": "bshd"}, tokenizer, seed=SEED)
    assert count_targets(data.placeholder, causal_lm=False) == 0
    model(**data.placeholder)  # runs as a batch does
    batches = list(data.read())
    first = validator(held_out_file, tokenizer, tmp_path, "bshd", max_batches=1).run(model, step=1)
    assert len(batches) == 2 and first["val_tokens"] == count_targets(batches[0], causal_lm=False)


def test_a_fasta_file_is_read_by_its_name(model, tokenizer, tmp_path):
    fasta = tmp_path / "held_out.fasta"
    fasta.write_text("".join(f">s{i}\n{s}\n" for i, s in enumerate(s for s in SEQUENCES if s)))
    assert validator(str(fasta), tokenizer, tmp_path).run(model, step=1)["val_tokens"] > 0


def test_bad_held_out_data_fails_before_training(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="point validation.path at"):
        validator(str(tmp_path / "missing.parquet"), tokenizer, tmp_path)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"sequence": ["MKTAYJ1"]}), bad)
    with pytest.raises(ConfigError, match="not residues of the tokenizer"):
        validator(str(bad), tokenizer, tmp_path)
    with pytest.raises(ConfigError, match="every_n_steps must be >= 1"):
        validator(str(bad), tokenizer, tmp_path, every_n_steps=0)


def test_no_path_means_never(tmp_path):
    cfg = OmegaConf.create({"path": None, "every_n_steps": 0, "max_batches": None})
    val = Validator(cfg, None, dp_rank=0, device=torch.device("cpu"), output_dir=tmp_path)
    assert not val.enabled and not any(val.due(step) for step in range(1, 100))


def test_a_resumed_run_drops_the_rows_it_validates_again(tmp_path):
    """A job killed after validating step 40 but before its step-40 checkpoint: the run resumed from step 20 drops
    the rows after 20 (a torn last line too), so validation.jsonl holds each step once after it validates 40 again."""
    rows = [{"step": 20, "val_loss": 2.0}, {"step": 40, "val_loss": 1.5}]
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6')
    cfg = OmegaConf.create({"path": None, "every_n_steps": 20, "max_batches": None})
    val = Validator(cfg, None, dp_rank=0, device=torch.device("cpu"), output_dir=tmp_path)
    val.resume_at(0)  # a fresh start touches nothing
    assert (tmp_path / "validation.jsonl").read_text().endswith('{"step": 6')
    val.resume_at(20)
    assert (tmp_path / "validation.jsonl").read_text() == json.dumps(rows[0]) + "\n"
