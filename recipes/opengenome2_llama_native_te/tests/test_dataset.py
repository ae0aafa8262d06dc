"""Streaming sources, rank splits, <bos>/<eos> through the whole loader, exact resume and bad input."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from collator import IGNORE_INDEX
from dataset import create_dataloader, iter_records, resolve_files, validation_batches


BOS, EOS = 1, 2


def write_jsonl_gz(path, sequences, key="text"):
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps({key: s, "record": i}) + "\n" for i, s in enumerate(sequences))
    return path


def random_dna(rng, lengths) -> list[str]:
    return ["".join(rng.choice(list("ACGT"), n)) for n in lengths]


def decode(batch) -> list[str]:
    """The sequences of a THD batch, as text (<bos> = '^', <eos> = '$')."""
    tokens, cu = batch["input_ids"][0].tolist(), batch["cu_seq_lens_q"].tolist()
    text = "".join("^" if t == BOS else "$" if t == EOS else chr(t) for t in tokens)
    return [text[a:b] for a, b in zip(cu[:-1], cu[1:])]


def test_all_sources_read_alike(tmp_path):
    seqs = ["ACGTACGTAC", "GGGNNcccTT", "A" * 25]
    write_jsonl_gz(tmp_path / "x.jsonl.gz", seqs)
    with gzip.open(tmp_path / "x.fa.gz", "wt") as fh:
        fh.writelines(f">s{i} description\n{s[:4]}\n{s[4:]}\n\n" for i, s in enumerate(seqs))
    pq.write_table(pa.table({"text": seqs}), tmp_path / "x.parquet")
    for name in ("x.jsonl.gz", "x.fa.gz", "x.parquet"):
        assert [r.text for _, r in iter_records(tmp_path / name)] == seqs, name
    assert len(resolve_files(str(tmp_path))) == 3 and len(resolve_files(str(tmp_path / "x.*"))) == 3


def test_records_are_streamed_not_loaded(tmp_path):
    """A broken last line is only noticed when the reader gets there: the file is read lazily, record by record."""
    path = tmp_path / "lazy.jsonl"
    path.write_text('{"text": "ACGT"}\n{"text": "GGCC"}\n{broken\n')
    records = iter_records(path)
    assert next(records)[1].text == "ACGT" and next(records)[1].text == "GGCC"
    with pytest.raises(ValueError, match=r"lazy.jsonl:3: not a JSON object"):
        next(records)


def test_bos_and_eos_only_at_true_sequence_boundaries(tmp_path, tokenizer):
    """One 50-base sequence in 16-token windows overlapping by 4: one <bos>, one <eos>, in the first/last window."""
    seq = "".join(np.random.default_rng(0).choice(list("ACGT"), 50))
    cfg = {"path": str(write_jsonl_gz(tmp_path / "one.jsonl.gz", [seq])), "max_seq_length": 16, "window_overlap": 4}
    cfg.update(token_budget=1000, split_samples=False)
    (batch,) = validation_batches(cfg, tokenizer, cfg["path"])
    windows = decode(batch)
    assert windows == ["^" + seq[:15], seq[11:27], seq[23:39], seq[35:] + "$"]  # 52 tokens, starts 0, 12, 24, 36
    labels = batch["labels"][0].tolist()
    assert labels[0] == IGNORE_INDEX and labels[-1] == EOS  # <bos> is never a target, <eos> is


def test_degenerate_bases_are_masked_and_soft_masked_ones_uppercased(tmp_path, tokenizer):
    path = write_jsonl_gz(tmp_path / "d.jsonl.gz", ["ACNNgtRA"])
    (batch,) = validation_batches({"path": str(path), "max_seq_length": 64, "window_overlap": 0}, tokenizer, str(path))
    assert decode(batch) == ["^ACNNgtRA$"]
    expected = [IGNORE_INDEX, ord("A"), ord("C"), IGNORE_INDEX, IGNORE_INDEX, ord("G"), ord("T"), IGNORE_INDEX]
    assert batch["labels"][0].tolist() == [*expected, ord("A"), EOS]


def test_parquet_chunk_flags_place_bos_and_eos(tmp_path, tokenizer):
    table = pa.table(
        {"text": ["AAAA", "CCCC", "GGGG"], "seq_start": [True, False, False], "seq_end": [False, False, True]}
    )
    pq.write_table(table, tmp_path / "chunks.parquet")
    (batch,) = validation_batches(
        {"path": str(tmp_path), "max_seq_length": 64, "window_overlap": 0}, tokenizer, str(tmp_path)
    )
    assert decode(batch) == ["^AAAA", "CCCC", "GGGG$"]


def _two_shards(tmp_path):
    rng = np.random.default_rng(1)
    write_jsonl_gz(tmp_path / "a.jsonl.gz", ["A" + s for s in random_dna(rng, [30, 50, 20])])
    write_jsonl_gz(tmp_path / "b.jsonl.gz", ["C" + s for s in random_dna(rng, [40, 25])])
    return str(tmp_path / "*.jsonl.gz")


def test_ranks_read_different_files_when_there_are_enough(tmp_path, tokenizer):
    path = _two_shards(tmp_path)
    firsts = []
    for rank in range(2):
        seqs = [s for batch in validation_batches({"path": path}, tokenizer, path, rank, 2) for s in decode(batch)]
        firsts.append({s[1] for s in seqs})  # the first base after <bos> tells the shard
    assert firsts == [{"A"}, {"C"}]


def test_ranks_interleave_records_of_too_few_files(tmp_path, tokenizer):
    seqs = random_dna(np.random.default_rng(2), [10, 11, 12, 13, 14])
    path = str(write_jsonl_gz(tmp_path / "one.jsonl.gz", seqs))
    got = [
        [s[1:-1] for b in validation_batches({"path": path}, tokenizer, path, r, 2) for s in decode(b)] for r in (0, 1)
    ]
    assert got == [[seqs[0], seqs[2], seqs[4]], [seqs[1], seqs[3]]]


def test_a_rank_without_data_fails_clearly(tmp_path, tokenizer):
    path = str(write_jsonl_gz(tmp_path / "one.jsonl.gz", ["ACGT"]))
    with pytest.raises(ValueError, match="rank 1 of 2 gets no sequences"):
        next(iter(create_dataloader({"path": path, "num_workers": 0}, tokenizer, dp_rank=1, dp_world_size=2)))


def test_thd_batches_are_exactly_full_and_cover_the_data(tmp_path, tokenizer):
    path = _two_shards(tmp_path)
    cfg = {"path": path, "max_seq_length": 32, "window_overlap": 8, "token_budget": 40, "num_workers": 0}
    batches = iter(create_dataloader(cfg, tokenizer, seed=3))
    assert all(next(batches)["input_ids"].shape == (1, 40) for _ in range(10))


@pytest.mark.parametrize(("input_format", "num_workers"), [("thd", 0), ("thd", 1), ("bshd", 0)])
def test_resume_restarts_at_the_same_token(tmp_path, tokenizer, input_format, num_workers):
    """Cut after 7 batches (windows split over batch boundaries, epochs > 1) and resume in a new loader."""
    path = _two_shards(tmp_path)
    cfg = {"path": path, "max_seq_length": 32, "window_overlap": 8, "token_budget": 40, "micro_batch_size": 3}
    cfg.update(input_format=input_format, num_workers=num_workers)
    reference = iter(create_dataloader(cfg, tokenizer, seed=5))
    expected = [next(reference)["input_ids"] for _ in range(14)]

    loader = create_dataloader(cfg, tokenizer, seed=5)
    batches = iter(loader)
    for _ in range(7):
        next(batches)
    state = loader.state_dict()
    resumed = create_dataloader(cfg, tokenizer, seed=5)
    resumed.load_state_dict(state)
    got = [batch["input_ids"] for _, batch in zip(range(7), resumed)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected[7:]))


def test_file_order_is_seeded(tmp_path, tokenizer):
    for name in "abcd":
        write_jsonl_gz(tmp_path / f"{name}.jsonl.gz", [name.upper() * 10])
    cfg = {"path": str(tmp_path), "max_seq_length": 64, "window_overlap": 0, "token_budget": 12, "num_workers": 0}

    def first_bases(seed):
        batches = iter(create_dataloader(cfg, tokenizer, seed=seed))
        return "".join(decode(next(batches))[0][1] for _ in range(8))  # two epochs of four one-sequence batches

    assert first_bases(0) == first_bases(0)
    assert first_bases(0) != first_bases(1)
    assert sorted(first_bases(0)[:4]) == list("ABCD")  # an epoch visits every file once


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ACGT"}\nnot json\n', r"bad.jsonl:2: not a JSON object"),
        ('{"sequence": "ACGT"}\n', r"bad.jsonl:1: no string under key 'text'"),
        ('{"text": 5}\n', r"bad.jsonl:1: no string under key 'text'"),
    ],
)
def test_malformed_jsonl_fails_with_file_and_line(tmp_path, tokenizer, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        next(iter(create_dataloader({"path": str(tmp_path / "bad.jsonl"), "num_workers": 0}, tokenizer)))


def test_other_bad_inputs_fail_clearly(tmp_path, tokenizer):
    (tmp_path / "bad.fa").write_text("ACGT\n>s\nAC\n")
    (tmp_path / "x.txt").write_text("ACGT\n")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ACGT"}\n' * 1000)[:60])
    with pytest.raises(ValueError, match="before the first '>'"):
        list(iter_records(tmp_path / "bad.fa"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        list(iter_records(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="cut.jsonl.gz: cannot be read"):
        list(iter_records(tmp_path / "cut.jsonl.gz"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_dataloader({"path": str(tmp_path / "missing.jsonl.gz")}, tokenizer)
    with pytest.raises(FileNotFoundError, match="names no data files"):
        create_dataloader({"path": str(tmp_path / "*.parquet")}, tokenizer)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sequence_colum": "x"}, "unknown dataset config keys"),
        ({"window_overlap": 64}, "window_overlap"),
        ({"input_format": "sbhd"}, "input_format"),
        ({"num_workers": 4}, "num_workers"),
        ({"split_samples": False, "token_budget": 16}, "token_budget"),
    ],
)
def test_bad_config_fails(tmp_path, tokenizer, change, message):
    path = str(write_jsonl_gz(tmp_path / "x.jsonl.gz", ["ACGT"]))
    with pytest.raises(ValueError, match=message):
        create_dataloader({"path": path, "max_seq_length": 64, "window_overlap": 0, **change}, tokenizer)


def test_resuming_with_other_files_is_refused(tmp_path, tokenizer):
    path = _two_shards(tmp_path)
    state = create_dataloader({"path": path, "num_workers": 0}, tokenizer).dataset.state_dict()
    single = create_dataloader({"path": str(tmp_path / "a.jsonl.gz"), "num_workers": 0}, tokenizer)
    with pytest.raises(ValueError, match="Keep dataset.path unchanged"):
        single.dataset.load_state_dict(state)


def test_a_stream_left_open_closes_quietly_at_exit(tmp_path):
    """A process that stops reading mid-stream (num_workers=0) exits without "Exception ignored" noise: closing the
    record generator at interpreter exit must not evaluate the except clause for unreadable files, whose pyarrow
    names may already be gone then."""
    path = write_jsonl_gz(tmp_path / "x.jsonl.gz", random_dna(np.random.default_rng(0), [900, 700]))
    recipe = Path(__file__).resolve().parents[1]
    script = (
        "from transformers import AutoTokenizer\n"
        "from dataset import create_dataloader\n"
        "tokenizer = AutoTokenizer.from_pretrained('tokenizer')\n"
        f"loader = create_dataloader({{'path': {str(path)!r}, 'max_seq_length': 256, 'window_overlap': 0, "
        "'token_budget': 512, 'num_workers': 0}, tokenizer)\n"
        "stream = iter(loader)\n"
        "next(stream)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=recipe, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
