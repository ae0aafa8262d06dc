"""Reading, validating, sharding and resuming protein data (dataset.py), on tiny files written per test."""

import gzip
import io
import json
import logging
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from collator import IGNORE_INDEX
from dataset import SequencePolicy, create_dataloader, load_sequences, read_fasta, tokenize_dataset
from transformers import AutoTokenizer


RECIPE = Path(__file__).resolve().parents[1]
RECORDS = [("p1", "MKTAYIAKQR"), ("p2", "GSHMLEDPVDAFQ"), ("p3", "ACDEFGHIKLMNPQRSTVWY"), ("p4", "MW")]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(RECIPE / "tokenizer")


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def write_fasta(path, records, width=4):
    """FASTA with descriptions, sequences wrapped over several lines and blank lines in between."""
    lines = []
    for name, seq in records:
        lines += [f">{name} some description", *(seq[i : i + width] for i in range(0, len(seq), width)), ""]
    text = "\n".join(lines)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as handle:
            handle.write(text)
    else:
        Path(path).write_text(text)
    return path


def write_source(tmp_path, fmt, records=RECORDS, column="sequence"):
    frame = pd.DataFrame({"id": [r[0] for r in records], column: [r[1] for r in records]})
    if fmt == "parquet":
        frame.to_parquet(path := tmp_path / "seqs.parquet")
    elif fmt == "csv":
        frame.to_csv(path := tmp_path / "seqs.csv", index=False)
    elif fmt == "jsonl":
        path = tmp_path / "seqs.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in frame.to_dict("records")))
    elif fmt == "fasta":
        path = write_fasta(tmp_path / "seqs.fasta", records)
    elif fmt == "fasta.gz":
        path = write_fasta(tmp_path / "seqs.fa.gz", records)
    else:  # an HF dataset directory (what load_dataset(path) reads without a hub)
        (path := tmp_path / "hf_dir").mkdir()
        frame.to_parquet(path / "train.parquet")
    return str(path)


def decode(ids, tokenizer):
    return "".join(tokenizer.convert_ids_to_tokens([int(i) for i in ids]))


def sequences_in(batch, tokenizer):
    """The residues of each sequence in a BSHD or THD batch, masking undone (labels hold the originals)."""
    ids = torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].tolist()
        rows = [ids[0, a:b] for a, b in zip(cu[:-1], cu[1:])]
    else:
        rows = [row[mask.bool()] for row, mask in zip(ids, batch["attention_mask"])]
    return [decode(row[1:-1], tokenizer) for row in rows if row[0] == tokenizer.cls_token_id]


# ----------------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl", "fasta", "fasta.gz", "hf"])
def test_every_source_format_reads_the_sequences(tmp_path, cache, fmt, streaming):
    ds = load_sequences(write_source(tmp_path, fmt), streaming=streaming, cache_dir=cache)
    assert [row["sequence"] for row in ds] == [seq for _, seq in RECORDS]
    assert [row["id"] for row in ds] == [name for name, _ in RECORDS]


def test_sequence_column_and_explicit_format(tmp_path, cache):
    path = tmp_path / "renamed.data"
    pd.DataFrame({"seq": ["MKT"], "other": [1]}).to_parquet(path)
    ds = load_sequences(str(path), format="parquet", sequence_column="seq", cache_dir=cache)
    assert ds["seq"] == ["MKT"]


def test_fasta_parser_handles_multiline_blank_lines_and_empty_records(tmp_path):
    path = tmp_path / "x.fasta"
    path.write_text("\n>a first\nMKT\nAY\n\n>b\n>c  spaced header\n  GSH  \n\n")
    assert list(read_fasta([str(path)])) == [
        {"id": "a", "sequence": "MKTAY"},
        {"id": "b", "sequence": ""},
        {"id": "c", "sequence": "GSH"},
    ]


@pytest.mark.parametrize("streaming", [False, True])
def test_malformed_fasta_names_file_and_line(tmp_path, cache, streaming):
    path = tmp_path / "bad.fasta"
    path.write_text("\nMKTAY\n>a\nGSH\n")
    with pytest.raises(ValueError, match=r"bad\.fasta: line 2 has residues before any '>' header"):
        list(load_sequences(str(path), streaming=streaming, cache_dir=cache))
    (empty := tmp_path / "empty.fa").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.fa: no '>' header"):
        list(read_fasta([str(empty)]))


def test_missing_file_and_glob_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        load_sequences(str(tmp_path / "nowhere.parquet"))
    with pytest.raises(FileNotFoundError, match=r"shard-\*\.fasta"):
        load_sequences(str(tmp_path / "shard-*.fasta"))


@pytest.mark.parametrize("streaming", [False, True])
def test_missing_column_lists_existing_columns(tmp_path, cache, streaming):
    path = write_source(tmp_path, "jsonl", column="seq")
    with pytest.raises(ValueError, match=r"no column 'sequence'.*\['id', 'seq'\]"):
        load_sequences(path, streaming=streaming, cache_dir=cache)


# -------------------------------------------------------------------------------------------------- validation


def tokenize(tokenizer, sequences, **policy):
    policy = SequencePolicy.from_tokenizer(tokenizer, **{"max_seq_length": 1024, **policy})
    ds, stats = tokenize_dataset(datasets.Dataset.from_dict({"sequence": sequences}), tokenizer, policy, seed=0)
    kept = [ids for ids, skip in zip(ds["input_ids"], ds["skip"]) if skip == 0]
    return kept, stats


def test_alphabet_comes_from_the_tokenizer(tokenizer):
    assert sorted(SequencePolicy.from_tokenizer(tokenizer, max_seq_length=10).alphabet) == sorted(
        "LAGVSERTIDPKQNFYMHWCXBUZO.-"
    )


def test_lowercase_and_whitespace(tokenizer):
    kept, _ = tokenize(tokenizer, ["mkt", " M K\nT "])
    assert kept == [[0, 20, 15, 11, 2], [0, 20, 15, 11, 2]]


def test_invalid_residues_error(tokenizer):
    with pytest.raises(ValueError, match=r"row 1: characters \['\*', 'J'\]"):
        tokenize(tokenizer, ["MKT", "AJC*"], invalid_residue_policy="error")


def test_invalid_residues_skip(tokenizer):
    kept, stats = tokenize(tokenizer, ["MKT", "AJC", "A"], invalid_residue_policy="skip")
    assert kept == [[0, 20, 15, 11, 2], [0, 5, 2]]
    assert stats["skipped (invalid residues)"] == 1 and stats["kept"] == 2


def test_invalid_residues_replace_unk_one_per_character(tokenizer):
    kept, stats = tokenize(tokenizer, ["AJJC", "MKT"], invalid_residue_policy="replace_unk")
    assert kept == [[0, 5, 3, 3, 23, 2], [0, 20, 15, 11, 2]]  # A <unk> <unk> C
    assert stats["residues replaced by <unk>"] == 2 and stats["with replaced residues"] == 1


def test_empty_sequences_are_skipped_and_counted(tokenizer, caplog):
    kept, stats = tokenize(tokenizer, ["", "MKT", None, " \n"])
    assert kept == [[0, 20, 15, 11, 2]]
    assert stats["skipped (empty)"] == 3 and stats["seen"] == 4
    with caplog.at_level(logging.INFO, logger="dataset"):
        stats.log("tiny.parquet")
    assert "tiny.parquet: kept 1 of 4 sequences; skipped (empty): 3" in caplog.text


def test_long_sequences_truncate_to_a_seeded_window(tokenizer):
    residues = "ACDEFGHIKLMNPQRSTVWY"
    kept, stats = tokenize(tokenizer, [residues, "MKT"], max_seq_length=8)
    assert stats["truncated"] == 1 and stats["kept"] == 2
    window = decode(kept[0][1:-1], tokenizer)
    assert len(kept[0]) == 8 and kept[0][0] == 0 and kept[0][-1] == 2
    assert len(window) == 6 and window in residues
    again, _ = tokenize(tokenizer, [residues, "MKT"], max_seq_length=8)
    assert again[0] == kept[0]  # same seed and row: same window


def test_long_sequences_skip_or_error(tokenizer):
    kept, stats = tokenize(tokenizer, ["ACDEFG", "MKT"], max_seq_length=7, long_sequence_policy="skip")
    assert kept == [[0, 20, 15, 11, 2]] and stats["skipped (too long)"] == 1
    kept, stats = tokenize(tokenizer, ["ACDEF"], max_seq_length=7, long_sequence_policy="skip")
    assert stats["kept"] == 1  # 5 residues + <cls> + <eos> = 7 fits exactly
    with pytest.raises(ValueError, match=r"row 0: 6 residues > max_seq_length - 2 = 5"):
        tokenize(tokenizer, ["ACDEFG"], max_seq_length=7, long_sequence_policy="error")


# -------------------------------------------------------------------------------------------------- dataloader


def unique_sequences(n, seed=0):
    """n distinct sequences of varied length, written in residues only (no validation surprises)."""
    rng = torch.Generator().manual_seed(seed)
    alphabet = "ACDEFGHIKLMNPQRSTVWY"
    return [
        "".join(
            alphabet[i] for i in torch.randint(20, (int(torch.randint(5, 40, (1,), generator=rng)),), generator=rng)
        )
        + alphabet[k % 20]
        + alphabet[k // 20]
        for k in range(n)
    ]


def loader_config(path, cache, **overrides):
    cfg = {"path": path, "cache_dir": cache, "max_seq_length": 64, "micro_batch_size": 3, "token_budget": 128,
           "num_workers": 0}  # fmt: skip
    return {**cfg, **overrides}


@pytest.fixture
def parquet_path(tmp_path):
    path = tmp_path / "train.parquet"
    pd.DataFrame({"sequence": unique_sequences(24)}).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("streaming", [False, True])
def test_dp_ranks_read_disjoint_data(parquet_path, cache, tokenizer, streaming):
    all_sequences = set(unique_sequences(24))
    cfg = loader_config(parquet_path, cache, streaming=streaming)
    iters = [iter(create_dataloader(cfg, tokenizer, dp_rank=r, dp_world_size=2, seed=7)) for r in range(2)]
    epochs = []
    for _ in range(2):  # each rank sees 12 sequences per epoch = 4 batches of 3
        per_rank = [[s for _ in range(4) for s in sequences_in(next(it), tokenizer)] for it in iters]
        assert all(len(seqs) == 12 for seqs in per_rank)
        assert set(per_rank[0]).isdisjoint(per_rank[1])
        assert set(per_rank[0]) | set(per_rank[1]) == all_sequences
        epochs.append(per_rank[0])
    if not streaming:  # the sampler reshuffles every epoch
        assert epochs[0] != epochs[1]


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def same_batch(a, b) -> bool:
    same = lambda x, y: torch.equal(x, y) if torch.is_tensor(x) else x == y  # noqa: E731
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert same_batch(a, b)


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
@pytest.mark.parametrize("streaming", [False, True])
def test_resume_continues_exactly(parquet_path, cache, tokenizer, tmp_path, input_format, num_workers, streaming):
    cfg = loader_config(parquet_path, cache, input_format=input_format, num_workers=num_workers, streaming=streaming)
    make = lambda: create_dataloader(cfg, tokenizer, dp_rank=0, dp_world_size=1, seed=3)  # noqa: E731
    loader = make()
    iterator = iter(loader)
    take(iterator, 3)  # mid-epoch for BSHD and THD
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    # 24 sequences = 8 BSHD batches per epoch (THD: fewer), so the reference run crosses epoch boundaries.
    expected = take(iterator, 12)

    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=True))
    assert_same_batches(take(iter(resumed), 12), expected)
    # Guard against a vacuous pass: a loader that restarted from scratch would not match.
    assert not same_batch(next(iter(make())), expected[0])


def test_thd_batches_respect_the_token_budget(parquet_path, cache, tokenizer):
    cfg = loader_config(parquet_path, cache, input_format="thd", token_budget=80, pad_to_multiple_of=16)
    iterator = iter(create_dataloader(cfg, tokenizer, 0, 1, seed=0))
    for batch in take(iterator, 20):
        assert batch["input_ids"].shape[1] <= 80 and batch["input_ids"].shape[1] % 16 == 0


def test_cp_loader_yields_full_batches_padded_for_cp(parquet_path, cache, tokenizer):
    """The loader pads every sequence for CP and yields the full batch (what every rank of a CP group reads), and the
    shards the training loop cuts from it put it back together."""
    from context_parallel import shard_for_context_parallel, unshard_context_parallel

    for input_format in ("bshd", "thd"):
        cfg = loader_config(parquet_path, cache, input_format=input_format)
        full = next(iter(create_dataloader(cfg, tokenizer, 0, 1, seed=0, cp_size=2)))
        if input_format == "thd":
            boundaries = full["cu_seq_lens_q_padded"]
            assert bool(((boundaries[1:] - boundaries[:-1]) % 4 == 0).all())
        else:  # the same sequences and masks as without CP, only padded further
            plain = next(iter(create_dataloader(cfg, tokenizer, 0, 1, seed=0)))
            assert full["input_ids"].shape[1] % 4 == 0
            length = plain["input_ids"].shape[1]
            assert torch.equal(full["labels"][:, :length], plain["labels"])
            assert (full["labels"][:, length:] == -100).all()
        shards = [shard_for_context_parallel(full, r, 2) for r in (0, 1)]
        assert shards[0]["input_ids"].shape[1] * 2 == full["input_ids"].shape[1]
        assert_same_batches([unshard_context_parallel(shards)], [full])


def test_config_errors(parquet_path, cache, tokenizer):
    with pytest.raises(ValueError, match=r"unknown data config keys \['micro_batchsize'\]"):
        create_dataloader({"path": parquet_path, "micro_batchsize": 2}, tokenizer, 0, 1, 0)
    with pytest.raises(ValueError, match="token_budget 100 < max_seq_length 128"):
        create_dataloader(loader_config(parquet_path, cache, input_format="thd", token_budget=100, max_seq_length=128),
                          tokenizer, 0, 1, 0)  # fmt: skip


def test_tokenizer_may_be_given_as_a_path(parquet_path, cache):
    batch = next(iter(create_dataloader(loader_config(parquet_path, cache), RECIPE / "tokenizer", 0, 1, 0)))
    assert batch["input_ids"].shape[0] == 3


def test_shipped_sanity_data_is_small_and_clean(tokenizer, tmp_path, caplog):
    paths = [RECIPE / "data" / "sanity_proteins.parquet", RECIPE / "data" / "sanity_proteins_val.parquet"]
    assert sum(p.stat().st_size for p in paths) < 1_000_000
    lengths = {p.name: pd.read_parquet(p)["sequence"].str.len() for p in paths}
    assert len(lengths["sanity_proteins.parquet"]) == 2000 and len(lengths["sanity_proteins_val.parquet"]) == 200
    assert all(30 <= n <= 1000 for series in lengths.values() for n in series)
    cfg = loader_config(str(paths[0]), str(tmp_path / "cache"), max_seq_length=1024)
    with caplog.at_level(logging.INFO, logger="dataset"):
        create_dataloader(cfg, tokenizer, 0, 1, 0)
    assert "sanity_proteins.parquet: kept 2000 of 2000 sequences" in caplog.text
    assert "WARNING" not in io.StringIO(caplog.text).getvalue()
