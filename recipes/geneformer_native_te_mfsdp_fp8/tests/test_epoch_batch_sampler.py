# Copied from common/tests/test_epoch_batch_sampler.py — edit the source, then run ci/check_copies.py --fix
"""epoch_batch_sampler.EpochBatchSampler: the order of map-style data, its exact resume, and a resume on another
number of data-parallel ranks that continues the epoch; batches_in_order, one ordered pass over held-out rows.

References are independent of the code under test: torch's own ``DistributedSampler`` for the order, and plain set
arithmetic over the rows each rank was handed for "every row of an epoch once".
"""

import itertools

import numpy as np
import pytest
from epoch_batch_sampler import EpochBatchSampler, batches_in_order
from torch.utils.data.distributed import DistributedSampler


ROWS = np.arange(100, 197)  # 97 usable row ids (not 0..n-1, so positions and ids cannot be mixed up)
LENGTHS = np.random.default_rng(0).integers(5, 60, size=200)  # indexed by row id


def sampler(rank, world, token_budget=None, micro_batch_size=None, shuffle=True):
    if token_budget is None and micro_batch_size is None:
        micro_batch_size = 3
    return EpochBatchSampler(
        ROWS, LENGTHS, shuffle, dp_rank=rank, dp_world_size=world, seed=7, token_budget=token_budget,
        micro_batch_size=micro_batch_size,
    )  # fmt: skip


def take(samplers, steps):
    """Every rank draws ``steps`` batches in lockstep (a training step takes one from each); rows read, by epoch."""
    read = {}
    iterators = [iter(s) for s in samplers]
    for _ in range(steps):
        for batches in iterators:
            for epoch, row in next(batches):
                read.setdefault(epoch, []).append(row)
    return read


def resume(states, new_world, **kwargs):
    new = [sampler(rank, new_world, **kwargs) for rank in range(new_world)]
    messages = {s.continue_from(states) for s in new}
    assert len(messages) == 1
    return new, messages.pop()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_order_is_distributed_samplers(world, shuffle):
    for rank in range(world):
        s = sampler(rank, world, micro_batch_size=4, shuffle=shuffle)
        batches = iter(s)
        reference = DistributedSampler(ROWS, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=True)
        for epoch in range(2):
            reference.set_epoch(epoch)
            expected = ROWS[list(reference)].tolist()
            got = []
            while len(got) < len(expected):
                got += [row for e, row in next(batches) if e == epoch]
            assert got == expected


def test_exact_resume_on_the_same_ranks():
    first = sampler(1, 2, token_budget=100)
    batches = iter(first)
    for _ in range(7):
        next(batches)
    state = first.state_dict()
    expected = [next(batches) for _ in range(30)]  # crosses into the next epoch
    again = sampler(1, 2, token_budget=100)
    assert again.reads_like(state)
    again.load_state_dict(state)
    assert list(itertools.islice(iter(again), 30)) == expected
    assert not sampler(0, 2, token_budget=100).reads_like(state)
    assert not sampler(1, 3, token_budget=100).reads_like(state)
    # Another dataset on the same ranks: its position would name other rows, so it goes to continue_from, which
    # refuses it (the data then starts afresh, with a warning).
    other_data = EpochBatchSampler(ROWS[:-1], LENGTHS, dp_rank=1, dp_world_size=2, seed=7, token_budget=100)
    assert not other_data.reads_like(state)
    with pytest.raises(ValueError, match="another dataset"):
        other_data.continue_from([state, {**state, "dp_rank": 0}])


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (1, 3), (3, 2), (2, 4)])
@pytest.mark.parametrize("batching", [{"token_budget": 120}, {"micro_batch_size": 3}])
def test_another_number_of_ranks_finishes_the_epoch_without_repeating_a_row(old_world, new_world, batching):
    old = [sampler(rank, old_world, **batching) for rank in range(old_world)]
    read_before = take(old, 5)[0]
    new, message = resume([s.state_dict() for s in old], new_world, **batching)
    assert f"{old_world} DP ranks had read {len(read_before)} of epoch 0's {len(ROWS)} rows" in message

    read_after = []
    iterators = [iter(s) for s in new]
    while True:  # in lockstep until every new rank has finished epoch 0
        batches = [next(it) for it in iterators]
        rows = [row for batch in batches for epoch, row in batch if epoch == 0]
        if not rows:
            break
        read_after += rows
    assert not set(read_before) & set(read_after)  # nothing read twice
    assert len(read_after) == len(set(read_after))
    unread = len(ROWS) - len(read_before)
    assert len(read_after) == unread - unread % new_world  # everything else, but for drop_last's remainder
    assert set(read_before) | set(read_after) <= set(ROWS.tolist())


def test_later_epochs_are_plain_shards_of_the_new_world():
    old = [sampler(rank, 2) for rank in range(2)]
    take(old, 4)
    new, _ = resume([s.state_dict() for s in old], 3)
    epoch_one = {rank: [] for rank in range(3)}
    for rank, s in enumerate(new):
        for batch in iter(s):
            if batch[0][0] == 2:
                break
            epoch_one[rank] += [row for epoch, row in batch if epoch == 1]
    for rank in range(3):
        reference = DistributedSampler(ROWS, num_replicas=3, rank=rank, shuffle=True, seed=7, drop_last=True)
        reference.set_epoch(1)
        assert epoch_one[rank] == ROWS[list(reference)].tolist()


def test_ranks_that_stopped_in_different_epochs():
    """With token budgets one rank can finish its share of an epoch steps before another: the new world takes the
    earliest epoch's unread rows, and in the next epoch skips the rows the faster rank had already read there."""
    old = [sampler(0, 2, token_budget=60), sampler(1, 2, token_budget=60)]
    iterators = [iter(s) for s in old]
    read = {0: [], 1: []}
    while old[0].epoch == 0 or old[1].epoch == 0:  # rank 0 runs ahead into epoch 1
        for epoch, row in next(iterators[0]):
            read[epoch].append(row)
        if old[0].epoch == 1 and old[0].consumed > 0:
            break
    for epoch, row in next(iterators[1]):
        read[epoch].append(row)
    states = [s.state_dict() for s in old]
    assert states[0]["epoch"] == 1 and states[1]["epoch"] == 0

    (new,), _ = resume(states, 1, token_budget=60)
    seen = {0: [], 1: []}
    for batch in iter(new):
        if batch[0][0] == 2:
            break
        for epoch, row in batch:
            seen[epoch].append(row)
    for epoch in (0, 1):
        assert not set(read[epoch]) & set(seen[epoch])
        assert sorted(read[epoch] + seen[epoch]) == sorted(ROWS.tolist())  # one rank: no drop_last remainder


def test_a_chain_of_resumes_keeps_every_row_once():
    """2 ranks -> 3 -> 1 within one epoch, the middle world checkpointed and resumed again."""
    first = [sampler(rank, 2) for rank in range(2)]
    read = take(first, 3)[0]
    middle, _ = resume([s.state_dict() for s in first], 3)
    read += take(middle, 2)[0]
    (last,), message = resume([s.state_dict() for s in middle], 1)
    assert f"had read {len(read)} of epoch 0" in message
    rest = []
    for batch in iter(last):
        if batch[0][0] == 1:
            break
        rest += [row for _, row in batch]
    assert len(read) == len(set(read)) and not set(read) & set(rest)
    # One last rank has no drop_last remainder, and the middle world's remainder was left unread for it.
    assert sorted(read + rest) == sorted(ROWS.tolist())


def test_states_that_cannot_be_continued_say_why():
    old = [sampler(rank, 2) for rank in range(2)]
    take(old, 2)
    states = [s.state_dict() for s in old]
    with pytest.raises(ValueError, match="DP ranks \\[0\\] of 2"):
        sampler(0, 1).continue_from(states[:1])
    with pytest.raises(ValueError, match="another dataset"):
        EpochBatchSampler(ROWS[:-1], LENGTHS, dp_rank=0, dp_world_size=1, seed=7, micro_batch_size=3).continue_from(
            states
        )
    with pytest.raises(ValueError, match="predate"):
        sampler(0, 1).continue_from([{"epoch": 0, "consumed": 6}] * 2)
    disagreeing = [dict(states[0]), dict(states[0])]  # two CP ranks of DP rank 0 at different positions
    disagreeing[1]["consumed"] += 3
    with pytest.raises(ValueError, match="different positions"):
        sampler(0, 1).continue_from([*disagreeing, states[1]])


@pytest.mark.parametrize("batching", [{"micro_batch_size": 4}, {"token_budget": 100}])
def test_batches_in_order_hold_every_row_once_in_order(batching):
    batches = batches_in_order(ROWS, LENGTHS, **batching)
    assert np.concatenate(batches).tolist() == ROWS.tolist()  # nothing dropped, nothing reordered
    if "micro_batch_size" in batching:
        assert [len(b) for b in batches] == [4] * (len(ROWS) // 4) + [len(ROWS) % 4]
    else:  # greedy: each batch fits the budget, and the next row would not have
        assert all(LENGTHS[b].sum() <= 100 for b in batches)
        assert all(LENGTHS[a].sum() + LENGTHS[b[0]] > 100 for a, b in itertools.pairwise(batches))
    assert batches_in_order(ROWS[:0], LENGTHS, **batching) == []


def test_batches_in_order_refuse_a_row_longer_than_the_budget():
    with pytest.raises(ValueError, match="row 101 has 80 tokens > token_budget"):
        batches_in_order([100, 101], np.array([0] * 100 + [10, 80]), token_budget=50)
