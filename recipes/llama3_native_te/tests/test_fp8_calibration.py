# Copied from common/tests/test_fp8_calibration.py — edit the source, then run ci/check_copies.py --fix
"""fp8_calibration: the passes that set DelayedScaling's gradient scales before step 1, on the CPU.

TransformerEngine is not needed: stand-in modules carry the FP8 state TE keeps per module (``fp8_meta["scaling_bwd"]``
with ``scale`` and ``amax_history``), created on their first pass as TE does, and a pass sets a module's gradient
scale only once the module above it has one, the worst case of gradients cast to zero under a scale of 1 (on the GPU,
Llama 1B and ESM-2 650M needed 3 passes; see the recipes' GPU tests). The expected pass counts follow from that rule
by hand: one pass per module in the chain, plus the one that finds nothing new.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fp8_calibration import calibrate_delayed_scaling, calibrate_on_first_batch, uses_delayed_scaling


E5M2_MAX = 57344.0


class DelayedScaling:  # named as TE's recipe class: uses_delayed_scaling goes by the name
    pass


class Float8CurrentScaling:
    pass


class QuantizedGradientModule(torch.nn.Module):
    """A TE-like module with one quantized gradient; ``fp8_meta`` is empty until its first pass."""

    def __init__(self):
        super().__init__()
        self.fp8_meta = {}

    def record(self, amax: float) -> None:
        """What a pass leaves: the state, created with a scale of 1; a non-zero amax sets the scale from it."""
        if "scaling_bwd" not in self.fp8_meta:
            self.fp8_meta["scaling_bwd"] = SimpleNamespace(scale=torch.ones(1), amax_history=torch.zeros(4, 1))
        if amax > 0:
            state = self.fp8_meta["scaling_bwd"]
            state.amax_history[0, 0] = amax
            state.scale.fill_(E5M2_MAX / amax)

    def calibrated(self) -> bool:
        state = self.fp8_meta.get("scaling_bwd")
        return state is not None and bool(state.scale.item() != 1.0)


def chain_model(length: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[QuantizedGradientModule() for _ in range(length)])


def backward_pass(model: torch.nn.Sequential) -> None:
    """The gradient flows from the last module to the first; a module passes on a non-zero gradient only if it was
    calibrated before this pass (else its cast with a scale of 1 flushes it), and records an amax when it gets one."""
    calibrated_before = [module.calibrated() for module in model]
    gradient_arrives = True
    for index in reversed(range(len(model))):
        model[index].record(amax=1e-5 * (index + 1) if gradient_arrives else 0.0)
        gradient_arrives = gradient_arrives and calibrated_before[index]


def test_passes_run_until_a_pass_sets_no_new_gradient_scale():
    model = chain_model(5)
    passes = calibrate_delayed_scaling(model, lambda: backward_pass(model), zero_grad=lambda: None)
    assert passes == 5 + 1
    assert all(module.calibrated() for module in model)


def test_a_model_whose_scales_are_already_set_takes_two_passes():
    model = chain_model(5)
    for module in model:  # as after a resume that restored TE's FP8 state
        module.record(amax=1e-3)
    assert calibrate_delayed_scaling(model, lambda: backward_pass(model), zero_grad=lambda: None) == 2


def test_the_pass_limit_stops_with_a_warning(caplog):
    model = chain_model(5)
    with caplog.at_level(logging.WARNING):
        passes = calibrate_delayed_scaling(model, lambda: backward_pass(model), zero_grad=lambda: None, max_passes=3)
    assert passes == 3
    assert [module.calibrated() for module in model] == [False, False, True, True, True]
    assert "stopped after 3 passes" in caplog.text
    with pytest.raises(ValueError, match="max_passes"):
        calibrate_delayed_scaling(model, lambda: None, zero_grad=lambda: None, max_passes=0)


def calibrate_on_two_ranks(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = chain_model(2 if rank == 0 else 4)  # rank 0 alone would stop after 3 passes, rank 1 after 5
        messages = []
        handler = logging.Handler()
        handler.emit = lambda record: messages.append(record.getMessage())
        calibration_logger = logging.getLogger(calibrate_delayed_scaling.__module__)
        calibration_logger.setLevel(logging.INFO)
        calibration_logger.addHandler(handler)
        passes = calibrate_delayed_scaling(model, lambda: backward_pass(model), zero_grad=lambda: None)
        results[rank] = (passes, messages[-1])
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_the_same_number_of_passes(tmp_path):
    """A rank that stopped early would leave the others waiting in FSDP's or DDP's collectives."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(calibrate_on_two_ranks, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        assert {rank: passes for rank, (passes, _) in results.items()} == {0: 5, 1: 5}
        # 2 + 4 scales: the count the passes stop on is the sum over ranks, and the log says so
        assert results[0][1].endswith("set 6 gradient scales before step 1 (summed over 2 ranks)"), results[0][1]


def linear_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_the_first_batch_is_trained_on_and_the_passes_leave_no_trace():
    batches = [torch.full((2, 3), float(i)) for i in range(1, 4)]
    model, optimizer = linear_model_and_optimizer()
    weight_before = model.weight.detach().clone()
    seen = []

    def loss_of(batch):
        seen.append(batch)
        return (model(batch) * torch.rand(())).sum()  # draws from the RNG, as dropout or masking would

    torch.manual_seed(1)
    expected_next_random = torch.rand(())
    torch.manual_seed(1)
    returned = calibrate_on_first_batch(True, DelayedScaling(), model, optimizer, iter(batches), loss_of)
    assert torch.rand(()) == expected_next_random
    assert len(seen) == 2 and all(batch is batches[0] for batch in seen)  # no FP8 state: nothing new after pass 1
    assert model.weight.grad is None and not optimizer.state
    assert torch.equal(model.weight, weight_before)
    assert list(returned) == batches


def test_the_loss_is_weighted_as_one_of_grad_acc_steps_micro_batches():
    model, optimizer = linear_model_and_optimizer()
    batch = torch.tensor([[1.0, 2.0, 4.0]])
    gradients = []
    model.weight.register_hook(lambda grad: gradients.append(grad.clone()))
    calibrate_on_first_batch(
        True, DelayedScaling(), model, optimizer, iter([batch]), lambda b: model(b).sum(), grad_acc_steps=4
    )
    # d(sum(w . x))/dw = x, a quarter of it per micro-batch of four.
    assert torch.allclose(gradients[0], batch / 4)


@pytest.mark.parametrize(
    ("enabled", "recipe"), [(False, DelayedScaling()), (True, Float8CurrentScaling()), (True, None)]
)
def test_other_recipes_or_calibration_off_leave_the_batches_alone(enabled, recipe):
    model, optimizer = linear_model_and_optimizer()
    batches = iter([torch.ones(1, 3), torch.zeros(1, 3)])

    def loss_of(batch):
        raise AssertionError("no pass should run")

    assert calibrate_on_first_batch(enabled, recipe, model, optimizer, batches, loss_of) is batches
    assert torch.equal(next(batches), torch.ones(1, 3))


def test_only_delayed_scaling_needs_calibrating():
    assert uses_delayed_scaling(DelayedScaling())
    assert not uses_delayed_scaling(Float8CurrentScaling())
    assert not uses_delayed_scaling(None)
