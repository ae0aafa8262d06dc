import pytest
import torch
from scheduler import get_linear_schedule_with_warmup


def _lrs(num_steps: int, **kwargs) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)  # peak lr 1.0, so lr == ratio
    scheduler = get_linear_schedule_with_warmup(optimizer, **kwargs)
    lrs = []
    for _ in range(num_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_then_decay_by_hand():
    # warmup 4: 1/4, 2/4, 3/4, 4/4; decay over 5 steps from 1.0 to 0.5: 1 - 0.5 * k / 5; then the floor.
    expected = [0.25, 0.5, 0.75, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5]
    got = _lrs(12, num_warmup_steps=4, num_decay_steps=5, min_lr_ratio=0.5)
    assert got == pytest.approx(expected, abs=1e-12)


def test_no_warmup_decays_to_zero():
    expected = [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert _lrs(6, num_warmup_steps=0, num_decay_steps=4, min_lr_ratio=0.0) == pytest.approx(expected, abs=1e-12)


def test_resumed_scheduler_continues_where_it_stopped():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_decay_steps=4, min_lr_ratio=0.0)
    for _ in range(3):
        optimizer.step()
        scheduler.step()

    # A resumed run loads both states, as the checkpoint code does.
    optimizer2 = torch.optim.SGD([param], lr=2.0)
    scheduler2 = get_linear_schedule_with_warmup(optimizer2, num_warmup_steps=2, num_decay_steps=4, min_lr_ratio=0.0)
    optimizer2.load_state_dict(optimizer.state_dict())
    scheduler2.load_state_dict(scheduler.state_dict())
    # step index 3 is the second decay step: 2.0 * (1 - 1/4); index 4: 2.0 * (1 - 2/4)
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(1.5)
    optimizer2.step()
    scheduler2.step()
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs", [{"num_warmup_steps": -1, "num_decay_steps": 1}, {"min_lr_ratio": 1.5}])
def test_bad_arguments_are_rejected(kwargs):
    param = torch.nn.Parameter(torch.zeros(1))
    args = {"num_warmup_steps": 1, "num_decay_steps": 1, "min_lr_ratio": 0.0} | kwargs
    with pytest.raises(ValueError):
        get_linear_schedule_with_warmup(torch.optim.SGD([param], lr=1.0), **args)
