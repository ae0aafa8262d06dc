# Copied from common/tests/test_optimizer_settings.py — edit the source, then run ci/check_copies.py --fix
"""optimizer_settings: a resumed run trains with its config's optimizer settings and peak learning rate, and keeps the
checkpoint's optimizer state and schedule step."""

import logging

import pytest
import torch
from optimizer_settings import configured_settings, restore_configured_settings
from scheduler import get_linear_schedule_with_warmup


SCHEDULE = {"num_warmup_steps": 2, "num_decay_steps": 10}


def _build(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.98), schedule=SCHEDULE):
    """A model with two parameter groups (decayed weight, undecayed bias), AdamW and the recipes' schedule."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    groups = [{"params": [model.weight], "weight_decay": weight_decay}, {"params": [model.bias], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas)
    return model, optimizer, get_linear_schedule_with_warmup(optimizer, **schedule)


def _train(model, optimizer, scheduler, steps):
    for step in range(steps):
        model(torch.full((2, 4), float(step + 1))).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _checkpoint(steps=3):
    model, optimizer, scheduler = _build()
    _train(model, optimizer, scheduler, steps)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def _resume(checkpoint, **config):
    model, optimizer, scheduler = _build(**config)
    configured = configured_settings(optimizer, scheduler)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    changes = restore_configured_settings(optimizer, scheduler, configured, "step_3")
    return model, optimizer, scheduler, changes


def test_an_unchanged_config_resumes_exactly_as_the_checkpoint_left_it():
    checkpoint = _checkpoint()
    model, optimizer, scheduler, changes = _resume(checkpoint)
    assert changes == []
    assert optimizer.state_dict()["param_groups"] == checkpoint["optimizer"]["param_groups"]
    assert scheduler.state_dict() == checkpoint["scheduler"]


def test_a_changed_config_applies_from_the_resumed_step_and_keeps_the_state(caplog):
    checkpoint = _checkpoint()
    with caplog.at_level(logging.WARNING, logger="optimizer_settings"):
        model, optimizer, scheduler, changes = _resume(checkpoint, lr=4e-3, weight_decay=0.05, betas=(0.8, 0.95))
    # Step 3 of warmup 2 + 10 decay steps: 0.9 of the peak, the config's peak.
    assert [group["lr"] for group in optimizer.param_groups] == scheduler.get_last_lr() == [4e-3 * 0.9] * 2
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.05, 0.0]  # the bias stays undecayed
    assert all(tuple(group["betas"]) == (0.8, 0.95) for group in optimizer.param_groups)
    assert scheduler.base_lrs == [4e-3, 4e-3] and scheduler.last_epoch == 3
    saved_state = checkpoint["optimizer"]["state"]
    for index, param in enumerate([model.weight, model.bias]):
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], saved_state[index]["exp_avg"], rtol=0, atol=0)
    assert "group 0: weight_decay 0.1 -> 0.05" in changes
    assert "group 0: peak lr 0.01 -> 0.004" in changes
    assert any(change.startswith("group 1: betas") for change in changes)
    assert "Resuming from step_3 with this run's optimizer settings" in caplog.text

    _train(model, optimizer, scheduler, 1)  # the schedule goes on from the config's peak
    assert scheduler.get_last_lr() == [4e-3 * 0.8] * 2


def test_a_changed_schedule_sets_the_resumed_steps_lr():
    checkpoint = _checkpoint()
    _, optimizer, _, changes = _resume(checkpoint, schedule={"num_warmup_steps": 4, "num_decay_steps": 10})
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2] * 2  # step 3 of a 4-step warmup: 4/4
    assert changes == [f"group {i}: lr at step 3 {1e-2 * 0.9!r} -> 0.01 (the config's schedule)" for i in (0, 1)]


def test_another_number_of_parameter_groups_is_refused():
    model, optimizer, scheduler = _build()
    configured = configured_settings(optimizer, scheduler)
    optimizer.param_groups.pop()
    with pytest.raises(RuntimeError, match="1 parameter groups after loading step_3, the config built 2"):
        restore_configured_settings(optimizer, scheduler, configured, "step_3")
