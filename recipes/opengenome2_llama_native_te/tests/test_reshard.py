"""scripts/reshard_to_parquet.py: every row once, shuffled and seeded, shards of the requested size, chunks that
rebuild their sequences and keep <bos>/<eos> at the true ends, progress output and clear errors."""

import gzip
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from dataset import validation_batches
from launch import RECIPE_DIR


SCRIPT = RECIPE_DIR / "scripts" / "reshard_to_parquet.py"
sys.path.insert(0, str(SCRIPT.parent))
from reshard_to_parquet import reshard  # noqa: E402


def make_inputs(tmp_path) -> list[str]:
    rng = np.random.default_rng(0)
    seqs = ["".join(rng.choice(list("ACGTacgtN"), int(n))) for n in rng.integers(5, 60, size=53)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps({"text": s}) + "\n" for s in seqs[:30])
    with open(tmp_path / "b.fasta", "w") as fh:
        fh.writelines(f">b{i} desc\n{s[:20]}\n{s[20:]}\n" for i, s in enumerate(seqs[30:]))
    return seqs


def read_rows(output_dir) -> list[dict]:
    manifest = json.loads((output_dir / "manifest.json").read_text())
    return [row for name in manifest["shards"] for row in pq.read_table(output_dir / name).to_pylist()]


def test_every_sequence_once_in_shuffled_shards_of_the_asked_size(tmp_path):
    seqs = make_inputs(tmp_path)
    manifest = reshard(
        [str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.fasta")],
        tmp_path / "out",
        10,
        seed=1,
        num_buckets=3,
        progress=False,
    )
    assert manifest["sequences"] == manifest["rows"] == 53
    assert [pq.read_metadata(tmp_path / "out" / s).num_rows for s in manifest["shards"]] == [10] * 5 + [3]
    rows = read_rows(tmp_path / "out")
    assert Counter(r["text"] for r in rows) == Counter(seqs)
    assert [r["text"] for r in rows] != seqs  # shuffled...
    first_shard_sources = {r["id"].split(":")[0][0] for r in rows[:10]}
    assert first_shard_sources == {"a", "b"}  # ...across input files, not only within them
    assert {r["id"] for r in rows} >= {"a.jsonl.gz:0", "b0"}


def test_same_seed_same_shards_other_seed_other_order(tmp_path):
    make_inputs(tmp_path)
    inputs = [str(tmp_path / "*.*")]
    texts = {}
    for name, seed in (("one", 5), ("again", 5), ("other", 6)):
        reshard(inputs, tmp_path / name, 8, seed=seed, num_buckets=4, progress=False)
        texts[name] = [r["text"] for r in read_rows(tmp_path / name)]
    assert texts["one"] == texts["again"] and texts["one"] != texts["other"]


def test_chunks_rebuild_sequences_and_mark_true_ends(tmp_path, tokenizer):
    sequence = "".join(np.random.default_rng(1).choice(list("ACGT"), 50))
    (tmp_path / "in.fa").write_text(f">long\n{sequence}\n>short\nACGTA\n")
    reshard([str(tmp_path / "in.fa")], tmp_path / "out", 100, chunk_length=20, chunk_overlap=5, progress=False)
    rows = {r["id"]: r for r in read_rows(tmp_path / "out")}
    # Chunk starts 0, 15, 30 (stride 15): [0, 20), [15, 35), [30, 50); the short sequence is one chunk.
    assert sorted(rows) == ["long:0-20", "long:15-35", "long:30-50", "short:0-5"]
    assert [rows[f"long:{s}-{s + 20}"]["text"] for s in (0, 15, 30)] == [sequence[s : s + 20] for s in (0, 15, 30)]
    flags = {key: (row["seq_start"], row["seq_end"]) for key, row in rows.items()}
    assert flags == {
        "long:0-20": (True, False),
        "long:15-35": (False, False),
        "long:30-50": (False, True),
        "short:0-5": (True, True),
    }
    # The training loader reads the shards: one <bos> and one <eos> per original sequence, however it was chunked.
    batches = list(validation_batches({"max_seq_length": 64, "window_overlap": 0}, tokenizer, str(tmp_path / "out")))
    tokens = [t for batch in batches for t in batch["input_ids"][0].tolist()]
    assert tokens.count(1) == 2 and tokens.count(2) == 2


def run_cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)


def test_cli_reports_progress_and_a_summary(tmp_path):
    make_inputs(tmp_path)
    result = run_cli(str(tmp_path / "a.jsonl.gz"), "--output-dir", str(tmp_path / "out"), "--rows-per-shard", "7")
    assert result.returncode == 0, result.stderr
    assert "pass 1/2" in result.stderr and "pass 2/2" in result.stderr
    assert "\r" not in result.stderr  # stderr is a pipe here: log lines, no progress bar
    assert "wrote 30 rows from 30 sequences into 5 shard(s)" in result.stderr


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["missing.jsonl.gz"], "does not exist"),
        ('{"text": "ACGT"}\n{"text": \n', ["bad.jsonl"], "bad.jsonl:2: not a JSON object"),
        ('{"seq": "ACGT"}\n', ["bad.jsonl"], "no string under key 'text'"),
        ("ACGT\n", ["bad.fa"], "before the first '>' header"),
        ('{"text": "ACGT"}\n', ["bad.jsonl", "--chunk-length", "10", "--chunk-overlap", "10"], "--chunk-overlap"),
    ],
)
def test_cli_errors_are_clear(tmp_path, setup, args, message):
    if setup is not None:
        (tmp_path / args[0]).write_text(setup)
    result = run_cli(str(tmp_path / args[0]), *args[1:], "--output-dir", str(tmp_path / "out"), "--quiet")
    assert result.returncode == 2
    assert "reshard_to_parquet: error:" in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_refuses_to_overwrite_without_being_asked(tmp_path):
    make_inputs(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run_cli(str(tmp_path / "a.jsonl.gz"), "--output-dir", str(tmp_path / "out"), "--quiet")
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
