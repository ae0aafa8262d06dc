"""A run resumed on another number of data-parallel ranks (or with another batch shape) reads each window of the
interrupted epoch once: the windows none of the old ranks had started, dealt out to the new ranks.

Which windows a rank reads is logged where the dataset takes them from ``WindowOrder.stream`` (every pull starts a
window: packing splits a window over batches and pulls the next one only when the current one is used up).
"""

import json

import numpy as np
import pytest
from dataset import create_dataloader
from recipe_paths import recipe_path
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(recipe_path("tokenizer"))


@pytest.fixture
def data_cfg(tmp_path):
    """40 sequences of 20-150 bases in windows of 32 tokens: full windows and short last ones, ~140 in all."""
    rng = np.random.default_rng(1)
    lines = [json.dumps({"sequence": "".join(rng.choice(list("ACGT"), n))}) for n in rng.integers(20, 150, 40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    return {"path": str(tmp_path / "d.jsonl"), "max_seq_length": 32, "num_workers": 0, "token_budget": 100}


def _dataset(tokenizer, cfg, rank, world):
    return create_dataloader(cfg, tokenizer, dp_rank=rank, dp_world_size=world, seed=7).dataset


def _read(dataset, batches: int) -> list[tuple[int, int]]:
    """Take ``batches`` batches from ``dataset``; the (epoch, window) pairs it started on the way."""
    pulled, stream = [], dataset.order.stream

    def logged(*args):
        for epoch, index, position in stream(*args):
            pulled.append((epoch, position))
            yield epoch, index, position

    dataset.order.stream = logged
    batches_taken = iter(dataset)
    for _ in range(batches):
        next(batches_taken)
    del dataset.order.stream
    return pulled


def _run_world(tokenizer, cfg, world, batches, earlier_states=None):
    """Every DP rank of a world takes ``batches`` batches (continuing ``earlier_states`` if given): their states and the
    windows each started."""
    states, pulled = [], []
    for rank in range(world):
        dataset = _dataset(tokenizer, cfg, rank, world)
        if earlier_states is not None:
            dataset.continue_from(earlier_states)
        pulled.append(_read(dataset, batches))
        states.append(dataset.state_dict())
    return states, pulled


def _in_epoch(pulled, epoch):
    return [position for rank in pulled for at_epoch, position in rank if at_epoch == epoch]


@pytest.mark.parametrize(
    ("old_world", "new_world", "input_format"),
    [(2, 1, "thd"), (1, 3, "thd"), (3, 2, "thd"), (2, 3, "bshd")],
)
def test_the_new_ranks_read_each_window_the_old_ones_had_not_started(
    tokenizer, data_cfg, old_world, new_world, input_format
):
    cfg = {**data_cfg, "input_format": input_format, "micro_batch_size": 3}
    num_windows = len(_dataset(tokenizer, cfg, 0, 1).windows)
    old_states, old_pulled = _run_world(tokenizer, cfg, old_world, batches=7)
    assert 0 < len(_in_epoch(old_pulled, 0)) < num_windows  # stopped inside epoch 0

    new_states, new_pulled = _run_world(tokenizer, cfg, new_world, batches=60, earlier_states=old_states)
    old_read, new_read = _in_epoch(old_pulled, 0), _in_epoch(new_pulled, 0)
    assert len(set(new_read)) == len(new_read) and not set(old_read) & set(new_read)
    assert sorted(old_read + new_read) == list(range(num_windows))
    assert all(rank[-1][0] >= 1 for rank in new_pulled)  # then on into the next epoch
    next_epoch = _in_epoch(new_pulled, 1)
    assert len(set(next_epoch)) == len(next_epoch)  # a whole new epoch, still each window once


def test_a_rank_ahead_by_an_epoch_and_a_second_resume(tokenizer, data_cfg):
    """Ranks drift apart (their windows differ in length), so an old rank may be an epoch ahead of another; and the
    continued world can itself be continued: 3 ranks, then 2, then 1, and epochs 1 and 2 are still read once each."""
    cfg = dict(data_cfg)
    states, pulled_3 = _run_world(tokenizer, cfg, 3, batches=23)
    assert [rank[-1][0] for rank in pulled_3] == [1, 2, 2]  # rank 0 is still in epoch 1, the others in epoch 2
    states, pulled_2 = _run_world(tokenizer, cfg, 2, batches=4, earlier_states=states)
    _, pulled_1 = _run_world(tokenizer, cfg, 1, batches=80, earlier_states=states)
    num_windows = len(_dataset(tokenizer, cfg, 0, 1).windows)
    assert pulled_1[-1][-1][0] > 2
    for epoch in (1, 2):
        read = [p for pulled in (pulled_3, pulled_2, pulled_1) for p in _in_epoch(pulled, epoch)]
        assert sorted(read) == list(range(num_windows)), epoch


def test_a_resume_with_another_token_budget_continues_the_epoch(tokenizer, data_cfg):
    """The same rank and world but another batch shape: batches_done no longer says where the stream stood, so the
    dataset asks to continue, and the old stream is replayed with the budget it had."""
    states, pulled = _run_world(tokenizer, data_cfg, 2, batches=5)
    bigger = {**data_cfg, "token_budget": 160}
    resumed = _dataset(tokenizer, bigger, 0, 2)
    assert resumed.reads_like(states[0]) is False
    assert _dataset(tokenizer, data_cfg, 0, 2).reads_like(states[0]) is True
    _, new_pulled = _run_world(tokenizer, bigger, 2, batches=40, earlier_states=states)
    num_windows = len(resumed.windows)
    assert sorted(_in_epoch(pulled, 0) + _in_epoch(new_pulled, 0)) == list(range(num_windows))


def test_a_continued_world_resumes_exactly_on_the_same_ranks(tokenizer, data_cfg):
    """After a continue, a plain resume (same world) restores the stream with its history, batch for batch; the loader
    with a worker process reads what the one without does (the worker gets the continued dataset)."""
    old_states, _ = _run_world(tokenizer, data_cfg, 2, batches=6)
    straight = create_dataloader(data_cfg, tokenizer, seed=7)
    straight.dataset.continue_from(old_states)
    batches = iter(straight)
    expected = [next(batches)["input_ids"] for _ in range(30)]

    with_worker = {**data_cfg, "num_workers": 1}
    interrupted = create_dataloader(with_worker, tokenizer, seed=7)
    interrupted.dataset.continue_from(old_states)
    batches = iter(interrupted)
    for number in range(12):
        assert np.array_equal(next(batches)["input_ids"], expected[number])
    resumed = create_dataloader(with_worker, tokenizer, seed=7)
    state = interrupted.state_dict()
    assert resumed.dataset.reads_like(resumed.dataset.position_in(state))
    resumed.load_state_dict(state)
    got = [b["input_ids"] for _, b in zip(range(18), resumed)]
    for a, b in zip(got, expected[12:], strict=True):
        assert np.array_equal(a, b)


def test_states_that_cannot_be_continued_are_refused(tokenizer, data_cfg):
    states, _ = _run_world(tokenizer, data_cfg, 2, batches=3)
    dataset = _dataset(tokenizer, data_cfg, 0, 1)
    with pytest.raises(ValueError, match="DP ranks \\[0\\] of 2"):
        dataset.continue_from(states[:1])
    with pytest.raises(ValueError, match="predate"):
        dataset.continue_from([{"batches_done": 3}])
    longer = _dataset(tokenizer, {**data_cfg, "max_seq_length": 40}, 0, 2)
    assert not longer.reads_like(states[0])  # replaying 3 batches over other windows would misplace the stream
    other_data = {**states[0], "num_windows": states[0]["num_windows"] + 1}  # e.g. another dataset.path
    assert not _dataset(tokenizer, data_cfg, 0, 2).reads_like(other_data)
    with pytest.raises(ValueError, match="other windows"):
        longer.continue_from(states)
    with pytest.raises(ValueError, match="stopped at different positions"):
        dataset.continue_from([*states, {**states[1], "batches_done": 4}])
