"""Reading FASTA/Parquet/JSONL, config errors, rank splitting and exact resume of the batch stream."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dataset import create_dataloader, read_sequences
from recipe_paths import recipe_path
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(recipe_path("tokenizer"))


SEQS = ["ACGTACGTAC", "GGGNNcccTT", "A" * 25]


def test_reads_all_formats_alike(tmp_path):
    fasta = tmp_path / "x.fa.gz"
    with gzip.open(fasta, "wt") as fh:
        for i, s in enumerate(SEQS):
            fh.write(f">s{i} description\n{s[:4]}\n{s[4:]}\n\n")
    pq.write_table(pa.table({"dna": SEQS}), tmp_path / "x.parquet")
    with gzip.open(tmp_path / "x.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps({"dna": s}) + "\n" for s in SEQS)
    assert read_sequences(str(fasta)) == SEQS
    assert read_sequences(str(tmp_path / "x.parquet"), sequence_column="dna") == SEQS
    assert read_sequences(str(tmp_path / "x.jsonl.gz"), sequence_column="dna") == SEQS
    assert read_sequences(str(tmp_path / "x.*"), sequence_column="dna") == SEQS * 3


def test_bad_inputs_fail_clearly(tmp_path):
    (tmp_path / "bad.fa").write_text("ACGT\n>s\nAC\n")
    (tmp_path / "empty.jsonl").write_text('{"sequence": ""}\n')
    (tmp_path / "x.txt").write_text("ACGT\n")
    pq.write_table(pa.table({"seq": SEQS}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="before the first '>'"):
        read_sequences(str(tmp_path / "bad.fa"))
    with pytest.raises(ValueError, match="empty"):
        read_sequences(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_sequences(str(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="no column 'sequence'"):
        read_sequences(str(tmp_path / "x.parquet"))
    with pytest.raises(FileNotFoundError):
        read_sequences(str(tmp_path / "missing.fa"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"typo_key": 1}, "unknown dataset config keys"),
        ({"window_overlap": 64}, "window_overlap"),
        ({"input_format": "sbhd"}, "input_format"),
        ({"num_workers": 4}, "num_workers"),
    ],
)
def test_bad_config_fails(tokenizer, change, message):
    cfg = {"path": str(recipe_path("data/sanity_dna.fasta")), "max_seq_length": 64, **change}
    with pytest.raises(ValueError, match=message):
        create_dataloader(cfg, tokenizer)


def _cfg(tmp_path, **kw):
    path = tmp_path / "d.jsonl"
    rng = np.random.default_rng(0)
    path.write_text(
        "".join(json.dumps({"sequence": "".join(rng.choice(list("ACGT"), n))}) + "\n" for n in [50, 90, 33])
    )
    return {"path": str(path), "max_seq_length": 32, "window_overlap": 8, "num_workers": 0, **kw}


def test_thd_batches_are_full_and_ranks_disjoint(tokenizer, tmp_path):
    cfg = _cfg(tmp_path, token_budget=40)
    firsts = []
    for rank in range(2):
        batches = iter(create_dataloader(cfg, tokenizer, dp_rank=rank, dp_world_size=2, seed=3))
        batch = next(batches)
        assert batch["input_ids"].shape == (1, 40)
        assert int(batch["cu_seq_lens_q"][-1]) == 40
        firsts.append(batch["input_ids"])
    assert not np.array_equal(firsts[0], firsts[1])


def test_context_parallel_batches_hold_the_same_tokens_padded(tokenizer, tmp_path):
    """cp_size=2: the same pieces as without CP, each padded to a multiple of 4; BSHD input is refused."""
    cfg = _cfg(tmp_path, token_budget=40)
    plain = next(iter(create_dataloader(cfg, tokenizer, seed=3)))
    cp = next(iter(create_dataloader(cfg, tokenizer, seed=3, cp_size=2)))
    cu, cu_padded = plain["cu_seq_lens_q"], cp["cu_seq_lens_q_padded"]
    assert ((cu_padded[1:] - cu_padded[:-1]) % 4 == 0).all()
    for start, end, padded_start in zip(cu[:-1], cu[1:], cu_padded[:-1]):
        piece = cp["input_ids"][0, padded_start : padded_start + end - start]
        assert torch.equal(piece, plain["input_ids"][0, start:end])
    with pytest.raises(ValueError, match="needs dataset.input_format=thd"):
        create_dataloader({**cfg, "input_format": "bshd"}, tokenizer, cp_size=2)


def test_a_sequence_one_token_longer_than_a_window_gives_a_full_and_a_short_window(tokenizer, tmp_path):
    """31 bases + <bos>/<eos> = 33 tokens, windows of 32: tokens 0..31, then the <eos> alone (not a second window of
    tokens 1..32 that would repeat 31 of them)."""
    bases = "ACGT" * 7 + "ACG"
    (tmp_path / "one.jsonl").write_text(json.dumps({"sequence": bases}) + "\n")
    cfg = {"path": str(tmp_path / "one.jsonl"), "max_seq_length": 32, "input_format": "bshd", "shuffle": False}
    batches = iter(create_dataloader({**cfg, "num_workers": 0}, tokenizer))
    first, second = next(batches)["input_ids"][0].tolist(), next(batches)["input_ids"][0].tolist()
    expected = [
        tokenizer.bos_token_id,
        *tokenizer(bases, add_special_tokens=False)["input_ids"],
        tokenizer.eos_token_id,
    ]
    assert len(expected) == 33
    assert first == expected[:32]
    assert second == [tokenizer.eos_token_id]
    assert next(batches)["input_ids"][0].tolist() == expected[:32]  # the next epoch starts over


@pytest.mark.parametrize("input_format", ["thd", "bshd"])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_restarts_at_the_same_batch(tokenizer, tmp_path, input_format, num_workers):
    cfg = _cfg(tmp_path, token_budget=40, micro_batch_size=3, input_format=input_format, num_workers=num_workers)
    reference = iter(create_dataloader(cfg, tokenizer, seed=5))
    expected = [next(reference)["input_ids"] for _ in range(12)]  # several epochs, windows split over batches

    loader = create_dataloader(cfg, tokenizer, seed=5)
    batches = iter(loader)
    for _ in range(7):
        next(batches)
    state = loader.state_dict()
    resumed = create_dataloader(cfg, tokenizer, seed=5)
    resumed.load_state_dict(state)
    got = [b["input_ids"] for _, b in zip(range(5), resumed)]
    for a, b in zip(got, expected[7:]):
        assert np.array_equal(a, b)


def test_natural_language_settings_keep_text_and_labels(tokenizer, tmp_path):
    """L2_lingua_1b's data settings: spaces kept, labels are the inputs, a tokenizer without a pad token works."""
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello world, ACGT n"}) + "\n")
    assert read_sequences(str(tmp_path / "t.jsonl"), sequence_column="text", strip_whitespace=False) == [
        "hello world, ACGT n"
    ]
    cfg = {
        "path": str(tmp_path / "t.jsonl"),
        "sequence_column": "text",
        "strip_whitespace": False,
        "uppercase_labels": False,
        "mask_degenerate_bases": False,
        "input_format": "bshd",
        "max_seq_length": 64,
        "num_workers": 0,
    }
    batch = next(iter(create_dataloader(cfg, tokenizer)))
    ids = batch["input_ids"][0].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert batch["labels"][0].tolist() == [-100, *ids[1:]]
