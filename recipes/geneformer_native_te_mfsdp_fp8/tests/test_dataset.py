"""Reading, validating, truncating, sharding and resuming rank-value encoded cells (dataset.py), on tiny Parquet
files written per test, and the shipped sanity corpus (data/sanity_cells.parquet, and its held-out set
data/sanity_cells_val.parquet)."""

import importlib.util
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from collator import IGNORE_INDEX
from dataset import create_dataloader, gene_token_ids, load_cells
from gene_tokenizer import build_gene_tokenizer
from user_errors import ConfigError, PathNotFoundError


RECIPE = Path(__file__).resolve().parents[1]
SANITY = RECIPE / "data" / "sanity_cells.parquet"
SANITY_VAL = RECIPE / "data" / "sanity_cells_val.parquet"
A, B, C = [10, 11, 12], [20, 21, 22, 23, 24], [30, 31]


def loader_config(path, **overrides) -> dict:
    cfg = {"path": str(path), "max_seq_length": 16, "micro_batch_size": 3, "token_budget": 24, "num_workers": 0,
           "input_format": "bshd", "shuffle": False, "mlm_probability": 0.0}  # fmt: skip
    return {**cfg, **overrides}


def first_batches(path, tokenizer, n=1, **overrides):
    iterator = iter(create_dataloader(loader_config(path, **overrides), tokenizer, 0, 1, seed=0))
    return [next(iterator) for _ in range(n)]


def distinct_cells(n: int) -> list[list[int]]:
    """``n`` cells of 2..8 genes; cell k starts with gene 1000 + k, which names it."""
    return [[1000 + k, *range(2000 + 10 * k, 2000 + 10 * k + 1 + k % 7)] for k in range(n)]


def cells_in(batch) -> list[list[int]]:
    """The cells of a BSHD or THD batch, masking undone (a label holds the original gene)."""
    ids = torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].tolist()
        return [ids[0, a:b].tolist() for a, b in zip(cu[:-1], cu[1:]) if ids[0, a] != 0]  # 0: padding pseudo-cell
    return [row[mask.bool()].tolist() for row, mask in zip(ids, batch["attention_mask"])]


# ------------------------------------------------------------------------------------------ batches by hand


def test_bshd_batch_pads_known_cells(write_cells, tokenizer):
    (batch,) = first_batches(write_cells([A, B, C]), tokenizer)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 0, 0], [20, 21, 22, 23, 24], [30, 31, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert (batch["labels"] == IGNORE_INDEX).all()  # mlm_probability 0: nothing to predict, nothing changed
    (padded,) = first_batches(write_cells([A, B, C]), tokenizer, pad_to_multiple_of=8)
    assert padded["input_ids"].shape == (3, 8) and padded["attention_mask"].sum(1).tolist() == [3, 5, 2]


def test_thd_batches_pack_known_cells_within_the_token_budget(write_cells, tokenizer):
    path = write_cells([A, B, C])
    first, second, third = first_batches(path, tokenizer, 3, input_format="thd", token_budget=8, max_seq_length=8)
    assert first["input_ids"].tolist() == [[10, 11, 12, 20, 21, 22, 23, 24]]  # 3 + 5 = 8 tokens; C does not fit
    assert first["cu_seq_lens_q"].tolist() == first["cu_seq_lens_k"].tolist() == [0, 3, 8]
    assert first["cu_seq_lens_q"].dtype == torch.int32
    assert first["max_length_q"] == first["max_length_k"] == 5
    assert second["input_ids"].tolist() == [[30, 31]] and second["cu_seq_lens_q"].tolist() == [0, 2]
    assert third["input_ids"].tolist() == first["input_ids"].tolist()  # the next epoch, same order (no shuffle)

    (padded,) = first_batches(path, tokenizer, input_format="thd", token_budget=8, max_seq_length=8,
                              pad_to_multiple_of=16)  # fmt: skip
    assert padded["cu_seq_lens_q"].tolist() == [0, 3, 8, 16]  # one 8-token <pad> pseudo-cell
    assert padded["input_ids"][0, 8:].tolist() == [0] * 8 and (padded["labels"][0, 8:] == IGNORE_INDEX).all()
    assert padded["max_length_q"] == 8


def test_long_cells_keep_their_top_ranked_genes(write_cells, tokenizer, caplog):
    path = write_cells([list(range(2, 12)), A])
    with caplog.at_level(logging.INFO, logger="dataset"):
        (batch,) = first_batches(path, tokenizer, max_seq_length=4)
    assert batch["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 0]]
    assert "read 2 cells from 1 file(s); 1 truncated to max_seq_length 4; 0 empty cells skipped" in caplog.text


def test_labels_hold_the_masked_genes_and_minus_100_elsewhere(write_cells, tokenizer):
    cells = distinct_cells(30)  # cell k starts with gene 1000 + k, which (masked or not) names it
    for input_format in ("bshd", "thd"):
        for batch in first_batches(write_cells(cells), tokenizer, 4, input_format=input_format, mlm_probability=0.5):
            ids, labels = batch["input_ids"], batch["labels"]
            original = torch.where(labels != IGNORE_INDEX, labels, ids)
            known = torch.zeros_like(ids)  # the cells as written, <pad> elsewhere
            if input_format == "bshd":
                for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
                    known[row, :n] = torch.tensor(cells[int(original[row, 0]) - 1000])
            else:
                cu = batch["cu_seq_lens_q"].tolist()
                for a, b in zip(cu[:-1], cu[1:]):
                    known[0, a:b] = torch.tensor(cells[int(original[0, a]) - 1000])
            selected = labels != IGNORE_INDEX
            assert torch.equal(labels[selected], known[selected])  # a label is the gene that was there
            assert torch.equal(ids[~selected], known[~selected])  # every other gene (and <pad>) is left as it is
            assert (known[selected] >= 2).all()  # padding is never a target
            assert 0.2 < selected.sum() / (known != 0).sum() < 0.8


def test_random_replacements_are_genes_never_special_tokens(write_cells, tiny_tokenizer):
    assert gene_token_ids(tiny_tokenizer) == (2, 8)
    rng = np.random.default_rng(0)
    cells = [list(rng.permutation(np.arange(2, 8))) for _ in range(60)]
    replaced = Counter()
    for batch in first_batches(write_cells(cells), tiny_tokenizer, 20, mlm_probability=0.9, micro_batch_size=6):
        ids, labels = batch["input_ids"], batch["labels"]
        swapped = (labels != IGNORE_INDEX) & (ids != 1) & (ids != labels)
        replaced.update(ids[swapped].tolist())
        assert not ((ids == 0) & (batch["attention_mask"] == 1)).any()  # no <pad> inside a cell
    assert set(replaced) <= set(range(2, 8)) and sum(replaced.values()) > 20


def test_gene_token_ids_skip_every_special_token(tokenizer):
    assert gene_token_ids(tokenizer) == (2, 25_426)
    # A published dictionary of a later version has <cls> and <eos> after <pad> and <mask>.
    vocabulary = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3, **{f"ENSG{i:011d}": i for i in range(4, 20)}}
    assert gene_token_ids(build_gene_tokenizer(vocabulary)) == (4, 20)


# ------------------------------------------------------------------------------------------------ sources


def test_directory_and_glob_read_every_file_in_order(write_cells, tokenizer, tmp_path):
    write_cells([A, B], name="shards/part-0.parquet")
    write_cells([C, [40], [50, 51]], name="shards/part-1.parquet")
    (tmp_path / "shards" / "notes.txt").write_text("not a shard")
    for path in (tmp_path / "shards", tmp_path / "shards" / "*.parquet"):
        cells = load_cells(path, tokenizer)
        assert [cells.cell(row).tolist() for row in range(len(cells))] == [A, B, C, [40], [50, 51]]
        (batch,) = first_batches(path, tokenizer, micro_batch_size=5)
        assert cells_in(batch) == [A, B, C, [40], [50, 51]]


def test_missing_paths_are_named(tmp_path, tokenizer):
    for path in (tmp_path / "nothing.parquet", tmp_path / "*.parquet", tmp_path):
        with pytest.raises(PathNotFoundError, match="matches no Parquet file"):
            create_dataloader(loader_config(path), tokenizer, 0, 1, 0)


def test_tokenizer_may_be_given_as_a_path(write_cells, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (batch,) = first_batches(write_cells([A, B, C]), str(tmp_path / "tokenizer"))
    assert batch["input_ids"][0].tolist() == [10, 11, 12, 0, 0]


# ------------------------------------------------------------------------------------------------- validation


def load_error(path, tokenizer, **overrides) -> str:
    with pytest.raises(ConfigError) as error:
        create_dataloader(loader_config(path, **overrides), tokenizer, 0, 1, 0)
    assert isinstance(error.value, ValueError)
    return str(error.value)


def test_missing_column_lists_the_columns_there_are(tmp_path, tokenizer):
    pq.write_table(pa.table({"genes": [[5, 6]], "cell_type": ["T"]}), path := tmp_path / "cells.parquet")
    message = load_error(path, tokenizer)
    assert "cells.parquet" in message and "no column 'input_ids'" in message and "['genes', 'cell_type']" in message
    message = load_error(path, tokenizer, input_ids_column="cell_type")
    assert "column 'cell_type' is string, not a list of integer gene token ids" in message


@pytest.mark.parametrize("values", [[5, 6], [[1.5, 2.0]], [["ENSG1"]]], ids=["int", "list<double>", "list<string>"])
def test_a_column_that_is_not_a_list_of_integers(tmp_path, tokenizer, values):
    pq.write_table(pa.table({"input_ids": values}), path := tmp_path / "cells.parquet")
    message = load_error(path, tokenizer)
    assert "column 'input_ids' is" in message and "not a list of integer gene token ids" in message


@pytest.mark.parametrize("bad_id", [25_426, 30_000, -3])
def test_gene_ids_outside_the_vocabulary_name_row_id_and_vocabulary(write_cells, tokenizer, bad_id):
    message = load_error(write_cells([[5, 6, 7], [8, bad_id, 9], [10, bad_id]]), tokenizer)
    assert f"cells.parquet row 1, column 'input_ids': gene token id {bad_id} is outside" in message
    assert "vocabulary of 25426 ids" in message and "2 such tokens" in message


def test_the_file_is_named_when_several_are_read(write_cells, tokenizer, tmp_path):
    write_cells([A, B], name="shards/a.parquet")
    write_cells([C, [40, 99_999]], name="shards/b.parquet")
    assert "b.parquet row 1, column 'input_ids': gene token id 99999" in load_error(tmp_path / "shards", tokenizer)


@pytest.mark.parametrize(("token", "name"), [(0, "<pad>"), (1, "<mask>")])
def test_special_tokens_inside_a_cell(write_cells, tokenizer, token, name):
    message = load_error(write_cells([A, B, [7, 8, token, 9]]), tokenizer)
    assert f"row 2, column 'input_ids': token id {token} ({name}) is a special token" in message


def test_a_null_gene_token(write_cells, tokenizer):
    assert "row 1, column 'input_ids': a null gene token" in load_error(write_cells([A, [5, None, 6]]), tokenizer)


def test_a_length_column_must_agree_with_the_cells(write_cells, tokenizer):
    assert load_cells(write_cells([A, B], length=[3, 5]), tokenizer).lengths.tolist() == [3, 5]
    message = load_error(write_cells([A, B, C], length=[3, 4, 2]), tokenizer)
    assert "row 1: column 'length' says 4 genes but column 'input_ids' holds 5" in message


def test_empty_cells_are_skipped_and_counted_or_an_error(write_cells, tokenizer, caplog):
    path = write_cells([A, [], None, C])
    with caplog.at_level(logging.INFO, logger="dataset"):
        batches = first_batches(path, tokenizer, 2, micro_batch_size=4)
    assert "2 empty cells skipped" in caplog.text and "WARNING" in caplog.text
    assert cells_in(batches[0]) == cells_in(batches[1]) == [A, C]  # every epoch holds only the two usable cells
    message = load_error(path, tokenizer, empty_cell_policy="error")
    assert "cells.parquet row 1, column 'input_ids': an empty cell (2 in the file)" in message
    assert "no usable cell" in load_error(write_cells([[], None]), tokenizer)


def test_config_errors(write_cells, tokenizer):
    path = write_cells([A, B, C])
    with pytest.raises(ConfigError, match=r"unknown data config keys \['micro_batchsize'\]; known keys: \[.*'token_"):
        create_dataloader({"path": str(path), "micro_batchsize": 2}, tokenizer, 0, 1, 0)
    assert "token_budget 100 < max_seq_length 128" in load_error(
        path, tokenizer, input_format="thd", token_budget=100, max_seq_length=128
    )
    assert "input_format must be bshd or thd" in load_error(path, tokenizer, input_format="sbhd")
    assert "empty_cell_policy must be one of" in load_error(path, tokenizer, empty_cell_policy="drop")
    assert "mlm_probability must be in [0, 1]" in load_error(path, tokenizer, mlm_probability=1.5)
    with pytest.raises(ConfigError, match="data config needs a path"):
        create_dataloader({**loader_config(path), "path": None}, tokenizer, 0, 1, 0)


# ------------------------------------------------------------------------------------ ranks and resumption


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def same_batch(a, b) -> bool:
    same = lambda x, y: torch.equal(x, y) if torch.is_tensor(x) else x == y  # noqa: E731
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def test_dp_ranks_read_disjoint_cells(write_cells, tokenizer):
    cells = distinct_cells(24)
    cfg = loader_config(write_cells(cells), shuffle=True, mlm_probability=0.15)
    iterators = [iter(create_dataloader(cfg, tokenizer, dp_rank=r, dp_world_size=2, seed=7)) for r in range(2)]
    epochs = []
    for _ in range(2):  # each rank reads 12 cells per epoch = 4 batches of 3
        per_rank = [[c[0] for _ in range(4) for c in cells_in(next(it))] for it in iterators]
        assert [len(names) for names in per_rank] == [12, 12]
        assert set(per_rank[0]).isdisjoint(per_rank[1])
        assert set(per_rank[0]) | set(per_rank[1]) == {c[0] for c in cells}
        epochs.append(per_rank[0])
    assert epochs[0] != epochs[1]  # reshuffled every epoch


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_resume_continues_exactly(write_cells, tokenizer, tmp_path, input_format, num_workers):
    cfg = loader_config(write_cells(distinct_cells(24)), input_format=input_format, num_workers=num_workers,
                        shuffle=True, mlm_probability=0.15)  # fmt: skip
    make = lambda: create_dataloader(cfg, tokenizer, dp_rank=0, dp_world_size=1, seed=3)  # noqa: E731
    loader = make()
    iterator = iter(loader)
    take(iterator, 3)  # mid-epoch
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    expected = take(iterator, 12)  # 24 cells = 8 BSHD batches per epoch: the reference crosses an epoch boundary

    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=True))
    got = take(iter(resumed), 12)
    assert all(same_batch(a, b) for a, b in zip(got, expected, strict=True))
    assert not same_batch(next(iter(make())), expected[0])  # a loader restarted from scratch would not match


# --------------------------------------------------------------------------------------------- sanity corpus


def load_generator():
    spec = importlib.util.spec_from_file_location("make_sanity_dataset", RECIPE / "scripts" / "make_sanity_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_sanity_cells_are_small_clean_and_load(tokenizer, caplog):
    assert SANITY.stat().st_size < 300_000
    table = pq.read_table(SANITY)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("length").type == pa.int32()
    cells = table.column("input_ids").to_pylist()
    assert len(cells) == 2000 and table.column("length").to_pylist() == [len(c) for c in cells]
    genes = np.concatenate(cells)
    assert genes.min() >= 2 and genes.max() < 25_426
    assert all(len(set(c)) == len(c) for c in cells)  # a rank-value encoding names each gene once
    with caplog.at_level(logging.INFO, logger="dataset"):
        batch = next(iter(create_dataloader(loader_config(SANITY, max_seq_length=256), tokenizer, 0, 1, 0)))
    assert "read 2000 cells from 1 file(s); 0 truncated to max_seq_length 256; 0 empty cells skipped" in caplog.text
    assert batch["input_ids"].shape[0] == 3


def test_sanity_cells_have_the_documented_structure():
    """Eight cell types with disjoint 48-gene programs (the genes of each connected by co-occurrence in a cell), and
    the masked targets' unigram entropy the generator's docstring states, computed here from the counts."""
    cells = pq.read_table(SANITY).column("input_ids").to_pylist()
    assert sorted(len(genes) for genes in programs(cells)) == [48] * 8
    counts = np.array(list(Counter(g for c in cells for g in c).values()), dtype=float)
    unigram_entropy = -np.sum(counts / counts.sum() * np.log(counts / counts.sum()))
    assert unigram_entropy == pytest.approx(5.87, abs=0.005)
    assert "H(gene)                           5.87" in load_generator().__doc__


def test_sanity_generator_is_deterministic(tmp_path):
    generator = load_generator()
    entropies = generator.write(tmp_path / "cells.parquet")
    assert pq.read_table(tmp_path / "cells.parquet").equals(pq.read_table(SANITY))
    assert entropies["H(gene)"] == pytest.approx(5.87, abs=0.005)
    assert entropies["H(gene | cell type)"] < entropies["H(gene)"] - 2


def test_held_out_sanity_cells_are_other_cells_of_the_same_programs(tmp_path):
    """data/sanity_cells_val.parquet (validation.path of L0_sanity): what the generator writes with --held-out, 200
    small clean cells, none of them a training cell, each expressing one training program."""
    generator = load_generator()
    generator.write(tmp_path / "val.parquet", generator.N_VAL_CELLS, cell_seed=generator.VAL_CELL_SEED)
    assert pq.read_table(tmp_path / "val.parquet").equals(pq.read_table(SANITY_VAL))
    assert SANITY_VAL.stat().st_size < 20_000
    train = pq.read_table(SANITY).column("input_ids").to_pylist()
    held_out = pq.read_table(SANITY_VAL).column("input_ids").to_pylist()
    assert len(held_out) == 200 and all(len(set(c)) == len(c) >= 24 for c in held_out)
    assert not {tuple(c) for c in held_out} & {tuple(c) for c in train}
    program_of = {gene: index for index, genes in enumerate(programs(train)) for gene in genes}
    assert all(len({program_of[gene] for gene in cell}) == 1 for cell in held_out)  # KeyError: a gene not in training


def programs(cells: list[list[int]]) -> list[set[int]]:
    """The genes of each program: the sets of genes connected by co-occurring in a cell."""
    parent = {}

    def root(gene):
        while parent.setdefault(gene, gene) != gene:
            gene = parent[gene]
        return gene

    for cell in cells:
        for gene in cell[1:]:
            parent[root(gene)] = root(cell[0])
    groups = {}
    for gene in parent:
        groups.setdefault(root(gene), set()).add(gene)
    return list(groups.values())
