"""dataset.py: every input format, the invalid-codon policies, truncation, the train/val split, and one clear error
for each kind of bad input. Expected token ids are computed here from the codon table (<CLS>=0, <SEP>=1, <UNK>=2,
codon = 5 + 16 a + 4 b + c with A, C, G, T = 0..3), independently of sequences.encode."""

import gzip
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataset import CodonSamples, data_files, read_sequences, split_rows
from user_errors import ConfigError, PathNotFoundError, UserError, user_error_message


BASE = {"A": 0, "C": 1, "G": 2, "T": 3, "U": 3}


def expected_ids(sequence: str, max_codons=None) -> list[int]:
    sequence = "".join(sequence.split()).upper()
    codons = [sequence[i : i + 3] for i in range(0, len(sequence), 3)][:max_codons]
    ids = [5 + 16 * BASE[c[0]] + 4 * BASE[c[1]] + BASE[c[2]] if len(c) == 3 and set(c) <= set(BASE) else 2
           for c in codons]  # fmt: skip
    return [0, *ids, 1]


def rows_of(data) -> list[list[int]]:
    return [data.tokens(i).tolist() for i in range(len(data))]


def write_table(path, **columns):
    table = pa.table(columns)
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        sep = "\t" if ".tsv" in path.name else ","
        lines = [sep.join(columns)] + [sep.join(str(v) for v in row) for row in zip(*columns.values())]
        text = "\n".join(lines) + "\n"
        if path.name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
    return path


def one_line_error(error_info) -> str:
    """The error is a user error, reported in one line; return that line."""
    assert isinstance(error_info.value, UserError)
    message = user_error_message(error_info.value)
    assert message is not None and "\n" not in message
    return message


# ------------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("suffix", [".fa", ".fasta", ".fna", ".ffn", ".fa.gz", ".fasta.gz"])
def test_fasta(tmp_path, suffix):
    text = ">seq1 some description\nATGAAA\nttt\n\n>seq2\nAUGUAA\n>seq3\nGGGCCC\n"
    path = tmp_path / f"records{suffix}"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    data = read_sequences(path)
    assert list(data.names) == ["seq1", "seq2", "seq3"]
    assert rows_of(data) == [expected_ids("ATGAAATTT"), expected_ids("ATGTAA"), expected_ids("GGGCCC")]
    assert rows_of(data)[0] == [0, 19, 5, 68, 1]  # ATG AAA TTT by hand
    assert data.labels is None


def test_parquet_with_and_without_id(tmp_path):
    path = write_table(tmp_path / "a.parquet", id=["x", "y"], sequence=["ATGCCC", "tttaaa"], other=[1, 2])
    data = read_sequences(path)
    assert list(data.names) == ["x", "y"]
    assert rows_of(data) == [expected_ids("ATGCCC"), expected_ids("TTTAAA")]
    path = write_table(tmp_path / "b.parquet", sequence=["ATGCCC", "GGG"])
    assert list(read_sequences(path).names) == ["b.parquet:0", "b.parquet:1"]


@pytest.mark.parametrize("name", ["t.csv", "t.tsv", "t.csv.gz", "t.tsv.gz"])
def test_csv_and_tsv(tmp_path, name):
    path = write_table(tmp_path / name, id=["007", "008"], cds=["ATGCCC", "GGGTTTAAA"], label=[0.5, 1.5])
    data = read_sequences(path, sequence_column="cds", label_column="label", task="regression")
    assert list(data.names) == ["007", "008"]  # digits stay text
    assert rows_of(data) == [expected_ids("ATGCCC"), expected_ids("GGGTTTAAA")]
    assert data.labels.dtype == np.float32 and data.labels.tolist() == [0.5, 1.5]


def test_classification_labels(tmp_path):
    path = write_table(tmp_path / "c.csv", sequence=["ATG", "CCC", "GGG"], label=["0", "2.0", "1"])
    data = read_sequences(path, label_column="label", task="classification")
    assert data.labels.dtype == np.int64 and data.labels.tolist() == [0, 2, 1]


def test_directory_reads_every_known_file_in_order(tmp_path, caplog):
    write_table(tmp_path / "b.csv", sequence=["CCCCCC"])
    (tmp_path / "a.fa").write_text(">first\nATG\n")
    write_table(tmp_path / "c.parquet", sequence=["GGG", "TTT"])
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / ".hidden.fa").write_text(">hidden\nAAA\n")
    with caplog.at_level(logging.INFO, logger="dataset"):
        data = read_sequences(tmp_path)
    assert rows_of(data) == [expected_ids(s) for s in ["ATG", "CCCCCC", "GGG", "TTT"]]
    assert list(data.names) == ["first", "b.csv:0", "c.parquet:0", "c.parquet:1"]
    assert "ignoring 1 file" in caplog.text
    assert [f.name for f in data_files(tmp_path)] == ["a.fa", "b.csv", "c.parquet"]


def test_relative_path_falls_back_to_the_recipe_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # data/ does not exist here
    data = read_sequences("data/sanity_val.parquet")
    assert len(data) == 300


# ------------------------------------------------------------------------------------- policies and truncation


def test_error_policy_names_file_sequence_and_position(tmp_path):
    path = write_table(tmp_path / "bad.csv", id=["ok", "broken"], sequence=["ATGAAA", "ATGNAA"])
    with pytest.raises(ConfigError) as error:
        read_sequences(path)
    message = one_line_error(error)
    assert str(path) in message and "'broken'" in message and "'N' at position 3" in message
    assert "invalid_codon_policy" in message


def test_error_policy_length_not_a_multiple_of_three(tmp_path):
    path = tmp_path / "x.fa"
    path.write_text(">short\nATGA\n")
    with pytest.raises(ConfigError, match=r"'short'.*length 4 is not a multiple of 3"):
        read_sequences(path)


def test_skip_policy_counts_and_logs(tmp_path, caplog):
    path = write_table(tmp_path / "s.csv", sequence=["ATGAAA", "ATGNAA", "ATGA", "CCC"])
    with caplog.at_level(logging.WARNING, logger="dataset"):
        data = read_sequences(path, invalid_codon_policy="skip")
    assert rows_of(data) == [expected_ids("ATGAAA"), expected_ids("CCC")]
    assert list(data.names) == ["s.csv:0", "s.csv:3"]
    assert data.counts == {"read": 4, "skipped": 2, "truncated": 0}
    assert "skipped 2" in caplog.text


def test_unk_policy_reads_bad_codons_as_unk(tmp_path):
    path = write_table(tmp_path / "u.csv", sequence=["ATGNAACC", "AAA"])
    data = read_sequences(path, invalid_codon_policy="unk")
    assert rows_of(data) == [[0, 19, 2, 2, 1], [0, 5, 1]]  # ATG, NAA -> <UNK>, CC (partial) -> <UNK>


def test_empty_sequences_are_never_kept(tmp_path):
    path = tmp_path / "e.fa"
    path.write_text(">empty\n>full\nATG\n")
    with pytest.raises(ConfigError, match="'empty'.*it is empty"):
        read_sequences(path)
    assert list(read_sequences(path, invalid_codon_policy="unk").names) == ["full"]


def test_truncation_keeps_the_first_codons_and_logs(tmp_path, caplog):
    path = write_table(tmp_path / "t.parquet", sequence=["ATG" + "AAA" * 10, "CCCGGG"])
    with caplog.at_level(logging.WARNING, logger="dataset"):
        data = read_sequences(path, max_codons=4)
    assert rows_of(data) == [expected_ids("ATGAAAAAAAAA"), expected_ids("CCCGGG")]
    assert data.counts["truncated"] == 1 and "truncated 1" in caplog.text


# ---------------------------------------------------------------------------------------------- split, samples


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_rows(1000, 0.1, seed=3)
    assert len(val) == 100 and len(train) == 900
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(1000))
    again = split_rows(1000, 0.1, seed=3)
    assert np.array_equal(again[1], val)
    assert not np.array_equal(split_rows(1000, 0.1, seed=4)[1], val)
    assert len(split_rows(10, 0.01, seed=0)[1]) == 1  # a positive fraction holds out at least one
    assert len(split_rows(10, 0.0, seed=0)[1]) == 0


@pytest.mark.parametrize("fraction", [1.0, -0.1])
def test_split_rejects_bad_fractions(fraction):
    with pytest.raises(ConfigError, match="val_fraction"):
        split_rows(10, fraction, seed=0)


def test_split_that_leaves_nothing_to_train():
    with pytest.raises(ConfigError, match="leaves none to train on"):
        split_rows(1, 0.5, seed=0)


def test_samples_carry_what_the_collator_needs(tmp_path):
    path = write_table(tmp_path / "l.csv", id=["a", "b"], sequence=["ATG", "CCCGGG"], label=[1.5, 2.5])
    samples = CodonSamples(read_sequences(path, label_column="label", task="regression"), with_names=True)
    first, second = samples.__getitems__([(3, 1), 0])
    assert first["input_ids"].dtype == np.int64 and first["input_ids"].tolist() == expected_ids("CCCGGG")
    assert (first["epoch"], first["sample_index"], first["label"], first["name"]) == (3, 1, 2.5, "b")
    assert (second["epoch"], second["sample_index"], second["label"]) == (0, 0, 1.5)


# --------------------------------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(PathNotFoundError) as error:
        read_sequences(tmp_path / "nope.fa", key="data.train_path")
    assert "data.train_path=" in one_line_error(error) and "no such file or directory" in str(error.value)


def test_directory_without_sequence_files(tmp_path):
    with pytest.raises(PathNotFoundError, match="it is empty"):
        read_sequences(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(PathNotFoundError, match=r"no sequence file.*notes.txt"):
        read_sequences(tmp_path)


@pytest.mark.parametrize("name", ["seqs.txt", "seqs.json", "seqs.parquet.gz"])
def test_unknown_extension(tmp_path, name):
    (tmp_path / name).write_text("ATG")
    with pytest.raises(ConfigError) as error:
        read_sequences(tmp_path / name)
    assert "unknown file type" in one_line_error(error) and ".fasta(.gz)" in str(error.value)


def test_empty_files(tmp_path):
    (tmp_path / "e.fa").write_text("")
    with pytest.raises(ConfigError, match="empty FASTA file"):
        read_sequences(tmp_path / "e.fa")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(ConfigError, match="empty CSV file"):
        read_sequences(tmp_path / "e.csv")
    (tmp_path / "h.csv").write_text("id,sequence\n")
    with pytest.raises(ConfigError, match="no rows"):
        read_sequences(tmp_path / "h.csv")


def test_malformed_fasta(tmp_path):
    (tmp_path / "m.fa").write_text("ATGAAA\n>late\nCCC\n")
    with pytest.raises(ConfigError) as error:
        read_sequences(tmp_path / "m.fa")
    assert "malformed FASTA" in one_line_error(error) and "line 1" in str(error.value)
    (tmp_path / "bin.fa").write_bytes(b">x\n\xff\xfe\x00ATG\n")
    with pytest.raises(ConfigError, match="not a readable FASTA"):
        read_sequences(tmp_path / "bin.fa")


def test_malformed_csv_and_parquet(tmp_path):
    (tmp_path / "m.csv").write_text("id,sequence\na,ATG\nb,CCC,extra\n")
    with pytest.raises(ConfigError) as error:
        read_sequences(tmp_path / "m.csv")
    assert "not a readable CSV file" in one_line_error(error) and "Expected 2 columns, got 3" in str(error.value)
    (tmp_path / "m.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(ConfigError, match="not a readable PARQUET file"):
        read_sequences(tmp_path / "m.parquet")


def test_missing_column_lists_the_columns(tmp_path):
    path = write_table(tmp_path / "c.parquet", id=["a"], seq=["ATG"])
    with pytest.raises(ConfigError) as error:
        read_sequences(path)
    assert "no column 'sequence'" in one_line_error(error) and "['id', 'seq']" in str(error.value)
    assert "sequence_column" in str(error.value)
    with pytest.raises(ConfigError, match=r"no column 'label'.*\['id', 'seq'\].*label_column"):
        read_sequences(path, sequence_column="seq", label_column="label", task="regression")


@pytest.mark.parametrize("bad", ["high", "", "nan"])
def test_labels_must_be_numbers(tmp_path, bad):
    path = write_table(tmp_path / "l.csv", id=["a", "b"], sequence=["ATG", "CCC"], label=["1.0", bad])
    with pytest.raises(ConfigError) as error:
        read_sequences(path, label_column="label", task="regression")
    assert "row 1 (sequence 'b')" in one_line_error(error) and "is not a number" in str(error.value)


def test_classification_labels_must_be_class_indices(tmp_path):
    path = write_table(tmp_path / "l.csv", sequence=["ATG", "CCC"], label=["1", "0.5"])
    with pytest.raises(ConfigError, match=r"row 1 .*'0.5' is not a class index"):
        read_sequences(path, label_column="label", task="classification")
    path = write_table(tmp_path / "n.csv", sequence=["ATG"], label=["-1"])
    with pytest.raises(ConfigError, match="not a class index"):
        read_sequences(path, label_column="label", task="classification")


def test_fasta_has_no_labels(tmp_path):
    (tmp_path / "f.fa").write_text(">a\nATG\n")
    with pytest.raises(ConfigError, match="FASTA file has no labels"):
        read_sequences(tmp_path / "f.fa", label_column="label", task="regression")


def test_nothing_usable(tmp_path):
    path = write_table(tmp_path / "n.csv", sequence=["NNN", "AT"])
    with pytest.raises(ConfigError) as error:
        read_sequences(path, invalid_codon_policy="skip")
    assert "no usable sequence (2 read, 2 skipped" in one_line_error(error)


def test_bad_arguments(tmp_path):
    path = write_table(tmp_path / "a.csv", sequence=["ATG"])
    with pytest.raises(ConfigError, match="invalid_codon_policy must be one of"):
        read_sequences(path, invalid_codon_policy="drop")
    with pytest.raises(ConfigError, match="task must be one of"):
        read_sequences(path, task="mlm2")
    with pytest.raises(ConfigError, match="max_codons must be a positive"):
        read_sequences(path, max_codons=0)
