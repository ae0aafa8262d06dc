# Copied from common/data_resume.py — edit the source, then run ci/check_copies.py --fix
"""What the Llama recipes' iterable datasets share to continue a run on another number of data-parallel ranks.

``checkpoint.Checkpointer`` hands such a dataset every saved rank's dataset state (``continue_from``); these two
functions find that state inside a ``StatefulDataLoader`` state and check that the states describe one whole world.
"""


def dataset_state_in(loader_state: dict | None) -> dict | None:
    """The dataset's own state inside a ``StatefulDataLoader`` state (no worker process, or one), if any."""
    if not loader_state:
        return None
    workers = loader_state.get("_snapshot", {}).get("_worker_snapshots")
    return workers["worker_0"].get("dataset_state") if workers else loader_state.get("dataset_state")


def states_by_dp_rank(states: list[dict], needed: tuple[str, ...]) -> tuple[int, dict[int, dict]]:
    """``(old world's number of DP ranks, {dp_rank: state})`` of every rank's saved dataset state (the CP ranks of one
    DP group saved equal ones). Raises ``ValueError`` when they cannot describe one earlier world: a state without a
    ``needed`` key (an older format), ranks disagreeing on the world or within a DP group, or a DP rank missing."""
    if any(key not in s for s in states for key in ("dp_rank", "dp_world_size", *needed)):
        raise ValueError("the checkpoint's data positions predate resuming on another number of ranks")
    worlds = {int(s["dp_world_size"]) for s in states}
    if len(worlds) != 1:
        raise ValueError(f"its ranks disagree on the number of data-parallel ranks ({sorted(worlds)})")
    (old_world,) = worlds
    by_rank: dict[int, dict] = {}
    for s in states:
        if by_rank.setdefault(int(s["dp_rank"]), s) != s:
            raise ValueError(f"the ranks of data-parallel rank {s['dp_rank']} stopped at different positions")
    if sorted(by_rank) != list(range(old_world)):
        raise ValueError(f"it holds the data positions of DP ranks {sorted(by_rank)} of {old_world}")
    return old_world, by_rank
