# Copied from common/tests/test_prediction_files.py — edit the source, then run ci/check_copies.py --fix
"""prediction_files.py: packed passes keep the input order within the budget, ranks' shares cover every row once in
order, and their files join into one table and one embedding matrix in input order, with no rank file left."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prediction_files import contiguous_share, merge_rank_files, packed_passes, write_rank_files


def test_packed_passes_fill_the_budget_and_keep_the_order():
    assert [list(run) for run in packed_passes([5, 5, 5, 12, 3, 3], 10)] == [[0, 1], [2], [3], [4, 5]]
    assert [list(run) for run in packed_passes([4, 6, 1], 10)] == [[0, 1], [2]]  # exactly full, then a new pass
    assert list(packed_passes([], 10)) == []


@pytest.mark.parametrize(("n_rows", "world_size"), [(7, 3), (2, 4), (0, 2), (6, 1)])
def test_contiguous_shares_cover_every_row_once_in_rank_order(n_rows, world_size):
    shares = [contiguous_share(n_rows, rank, world_size) for rank in range(world_size)]
    assert np.concatenate(shares).tolist() == list(range(n_rows))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_rank_files_join_in_rank_order_into_whole_files(tmp_path):
    shares = [(["a", "b"], np.arange(6, dtype=np.float32).reshape(2, 3)), ([], np.zeros((0, 0), np.float32))]
    shares.append((["c"], np.full((1, 3), 7, dtype=np.float32)))
    for rank, (ids, embeddings) in enumerate(shares):
        write_rank_files(tmp_path, rank, pa.table({"id": pa.array(ids, pa.string())}), embeddings, "cells")
    table, embeddings = merge_rank_files(tmp_path, len(shares), "cells")
    assert (table, embeddings) == (tmp_path / "cells.parquet", tmp_path / "embeddings.npy")
    assert pq.read_table(table).column("id").to_pylist() == ["a", "b", "c"]
    np.testing.assert_array_equal(np.load(embeddings), [[0, 1, 2], [3, 4, 5], [7, 7, 7]])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cells.parquet", "embeddings.npy"]


def test_a_rank_whose_rows_and_embeddings_disagree_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rank 1: 2 rows but 1 embeddings"):
        write_rank_files(tmp_path, 1, pa.table({"id": ["a", "b"]}), np.zeros((1, 4), np.float32), "cells")
