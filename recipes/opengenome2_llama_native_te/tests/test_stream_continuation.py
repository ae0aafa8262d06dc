"""A run resumed on another number of data-parallel ranks finishes what the old ranks had left of their passes, each
token once, and then starts new passes (``GenomicStream.continue_from``).

Which tokens a rank reads is logged where the stream hands out windows (``GenomicStream._windows``), each token named
by (file, record, window, position in the window); an old rank has read the tokens before its cursor.
"""

import gzip
import json
from dataclasses import astuple
from itertools import islice

import numpy as np
import pytest
from dataset import create_dataloader
from stream_order import Cursor, Unit, moved_position


@pytest.fixture
def files(tmp_path):
    """5 JSONL files of 3-8 sequences of 10-120 bases: windows of 32 tokens overlapping by 4, short last ones."""
    rng = np.random.default_rng(3)
    for number in range(5):
        lengths = rng.integers(10, 120, rng.integers(3, 9))
        with gzip.open(tmp_path / f"part_{number}.jsonl.gz", "wt") as fh:
            fh.writelines(json.dumps({"text": "".join(rng.choice(list("ACGT"), n))}) + "\n" for n in lengths)
    return tmp_path


def _cfg(path, **kw):
    return {"path": str(path), "max_seq_length": 32, "window_overlap": 4, "token_budget": 50, "num_workers": 0, **kw}


def _stream(tokenizer, cfg, rank, world):
    return create_dataloader(cfg, tokenizer, dp_rank=rank, dp_world_size=world, seed=11).dataset


def _read(stream, batches: int) -> dict[int, set]:
    """Take ``batches`` batches; the tokens read, by epoch, each as (file, record, window, position)."""
    handed_out, windows = [], stream._windows

    def logged(start):
        for cursor, piece in windows(start):
            file = stream._my_units(cursor.epoch)[cursor.file].file
            handed_out.append((cursor, file, len(piece)))
            yield cursor, piece

    stream._windows = logged
    batches_taken = iter(stream)
    for _ in range(batches):
        next(batches_taken)
    del stream._windows
    stop = astuple(stream.cursor)
    read: dict[int, set] = {}
    for cursor, file, length in handed_out:
        for position in range(cursor.offset, cursor.offset + length):
            if (*astuple(cursor)[:4], position) < stop:  # packing may have taken a window it had not used up
                read.setdefault(cursor.epoch, set()).add((file, cursor.record, cursor.window, position))
    return read


def _world(tokenizer, cfg, world, batches, earlier=None):
    """Every DP rank of a world takes ``batches`` batches (continuing the states ``earlier`` if given)."""
    streams, reads = [], []
    for rank in range(world):
        stream = _stream(tokenizer, cfg, rank, world)
        if earlier is not None:
            stream.continue_from(earlier)
        reads.append(_read(stream, batches))
        streams.append(stream)
    return [s.state_dict() for s in streams], reads, streams


def _all_tokens(tokenizer, cfg) -> set:
    """Every token of one pass over the data, read by one rank."""
    stream = _stream(tokenizer, {**cfg, "shuffle_files": False}, 0, 1)
    tokens = set()
    for cursor, piece in stream._windows(Cursor()):
        if cursor.epoch > 0:
            return tokens
        file = stream._my_units(0)[cursor.file].file
        tokens |= {(file, cursor.record, cursor.window, p) for p in range(cursor.offset, cursor.offset + len(piece))}


def _current_pass(reads, states) -> set:
    """What each rank read of the pass its cursor is in."""
    return set().union(*(read.get(state["cursor"]["epoch"], set()) for read, state in zip(reads, states)))


@pytest.mark.parametrize(
    ("old_world", "new_world", "batches", "old_epochs"),
    # (2, 1, 30): one old rank a pass ahead of the other; 6 ranks over 5 files keep every 6th record of each file.
    [(2, 3, 6, {0}), (3, 1, 4, {0}), (2, 1, 30, {1, 2}), (6, 4, 2, {0})],
)
def test_the_new_ranks_finish_the_old_passes_each_token_once(
    tokenizer, files, old_world, new_world, batches, old_epochs
):
    cfg = _cfg(files)
    old_states, old_reads, old_streams = _world(tokenizer, cfg, old_world, batches)
    assert {state["cursor"]["epoch"] for state in old_states} == old_epochs
    assert old_streams[0].by_file == (old_world <= 5)
    new_states, new_reads, new_streams = _world(tokenizer, cfg, new_world, 60, earlier=old_states)
    leftover_epoch = new_streams[0].first_epoch - 1
    assert leftover_epoch == max(state["cursor"]["epoch"] for state in old_states)
    old_part = _current_pass(old_reads, old_states)
    new_part = [read.get(leftover_epoch, set()) for read in new_reads]
    assert not any(a & b for i, a in enumerate(new_part) for b in new_part[i + 1 :])  # the new ranks share nothing
    assert not old_part & set().union(*new_part)
    assert old_part | set().union(*new_part) == _all_tokens(tokenizer, cfg)
    assert all(state["cursor"]["epoch"] >= leftover_epoch + 1 for state in new_states)  # then their own passes


def test_a_continued_run_continued_again(tokenizer, files):
    """2 ranks, then 3 that stop inside the leftover pass, then 1: the first pass is still read once."""
    cfg = _cfg(files)
    states_2, reads_2, _ = _world(tokenizer, cfg, 2, 5)
    states_3, reads_3, streams_3 = _world(tokenizer, cfg, 3, 2, earlier=states_2)
    leftover_3 = streams_3[0].first_epoch - 1
    assert all(state["cursor"]["epoch"] == leftover_3 for state in states_3)
    _, reads_1, streams_1 = _world(tokenizer, cfg, 1, 60, earlier=states_3)
    parts = [
        _current_pass(reads_2, states_2),
        set().union(*(read.get(leftover_3, set()) for read in reads_3)),
        reads_1[0].get(streams_1[0].first_epoch - 1, set()),
    ]
    assert sum(len(part) for part in parts) == len(set().union(*parts)) == len(_all_tokens(tokenizer, cfg))


def test_a_continued_world_resumes_exactly_on_the_same_ranks(tokenizer, files):
    """After a continue, a plain resume (same world) restores the cursor in the leftover pass, batch for batch, also
    when a worker process reads it."""
    cfg = _cfg(files)
    old_states, _, _ = _world(tokenizer, cfg, 2, 4)
    straight = create_dataloader(cfg, tokenizer, seed=11)
    straight.dataset.continue_from(old_states)
    batches = iter(straight)
    expected = [next(batches)["input_ids"] for _ in range(40)]

    with_worker = {**cfg, "num_workers": 1}
    interrupted = create_dataloader(with_worker, tokenizer, seed=11)
    interrupted.dataset.continue_from(old_states)
    batches = iter(interrupted)
    for number in range(7):
        assert np.array_equal(next(batches)["input_ids"], expected[number])
    state = interrupted.state_dict()
    resumed = create_dataloader(with_worker, tokenizer, seed=11)
    assert resumed.dataset.reads_like(resumed.dataset.position_in(state))
    resumed.load_state_dict(state)
    for got, want in zip((b["input_ids"] for _, b in zip(range(33), resumed)), expected[7:], strict=True):
        assert np.array_equal(got, want)


def test_states_that_cannot_be_continued_are_refused(tokenizer, files):
    cfg = _cfg(files)
    states, _, _ = _world(tokenizer, cfg, 2, 3)
    stream = _stream(tokenizer, cfg, 0, 1)
    with pytest.raises(ValueError, match="DP ranks \\[1\\] of 2"):
        stream.continue_from(states[1:])
    with pytest.raises(ValueError, match="predate"):
        stream.continue_from([{"cursor": states[0]["cursor"], "batches": 3, "num_files": 3}])
    with pytest.raises(ValueError, match="other files or in another order"):
        _stream(tokenizer, {**cfg, "shuffle_files": False}, 0, 1).continue_from(states)
    with pytest.raises(ValueError, match="stopped at different positions"):
        stream.continue_from([*states, {**states[0], "batches": 99}])
    assert stream.reads_like(states[0]) is False and _stream(tokenizer, cfg, 0, 2).reads_like(states[0])


def _record_positions(read: set, stride: int) -> set:
    """(file, record, window, position in window) as (file, record, position in record): windows start every stride."""
    return {(file, record, window * stride + position) for file, record, window, position in read}


def test_a_resume_with_longer_windows_moves_the_cursors_to_the_same_tokens(tokenizer, files):
    """The same ranks, then max_seq_length 32 -> 80 (a context extension): the cursors name the same tokens of their
    records under the new windows, so the old pass is still finished with no token read twice or skipped."""
    short, long = _cfg(files, window_overlap=0), _cfg(files, window_overlap=0, max_seq_length=80)
    old_states, old_reads, _ = _world(tokenizer, short, 2, 5)
    assert not _stream(tokenizer, long, 0, 2).reads_like(old_states[0])  # a plain cursor restore would misplace it
    _, new_reads, new_streams = _world(tokenizer, long, 2, 40, earlier=old_states)
    leftover_epoch = new_streams[0].first_epoch - 1
    old_part = _record_positions(_current_pass(old_reads, old_states), 32)
    new_part = [_record_positions(read.get(leftover_epoch, set()), 80) for read in new_reads]
    assert not old_part & (new_part[0] | new_part[1]) and not new_part[0] & new_part[1]
    assert old_part | new_part[0] | new_part[1] == _record_positions(_all_tokens(tokenizer, short), 32)


def test_every_token_of_a_record_is_found_again_under_other_windows(tokenizer, tmp_path):
    """Each position of a 100-base record, named under 32-token windows, moved to 48-token windows overlapping by 16
    (windows at 0, 32, 64): reading from the moved position starts at that very token, also past the last window's
    start + stride, where the naive window number (p // 32 = 3) does not exist."""
    bases = "".join(np.random.default_rng(5).choice(list("ACGT"), 100))
    with gzip.open(tmp_path / "one.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"text": bases}) + "\n")
    old = _stream(tokenizer, _cfg(tmp_path, window_overlap=0), 0, 1)
    record_tokens = np.concatenate([piece for _, piece in islice(old._windows(Cursor()), 4)])  # <bos> + 100 + <eos>
    assert len(record_tokens) == 102
    new = _stream(tokenizer, _cfg(tmp_path, max_seq_length=48, window_overlap=16), 0, 1)
    new.first_epoch = 1  # read a one-unit leftover pass, as continue_from sets up
    for token in range(len(record_tokens)):
        record, window, offset = moved_position((0, *divmod(token, 32)), old_stride=32, stride=32)
        new.leftover = [Unit(0, record=record, window=window, offset=offset)]
        _, piece = next(new._windows(Cursor(epoch=0)))
        assert np.array_equal(piece, record_tokens[token : token + len(piece)]), token
