"""checkpoint_io.py: checkpoints reach their name only when complete, a killed save never costs the last good one, and
ModelCheckpoint saves what the config asks for (every N steps, the newest k step files, the final step)."""

import io

import lightning as L
import pytest
import torch
import torch.distributed as dist
from checkpoint_io import (
    AtomicCheckpointIO,
    RecipeModelCheckpoint,
    extra_state_kept_when_absent,
    partial_path,
    resume_checkpoint,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from user_errors import ConfigError


class Unpicklable:
    """Fails half-way through torch.save, after the tensors before it were written: a save that dies mid-write."""

    def __reduce__(self):
        raise RuntimeError("disk full")


def test_a_failed_save_keeps_the_last_good_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": 1, "weights": torch.arange(1000.0)}, path)
    good = path.read_bytes()
    assert not partial_path(path).exists()
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"weights": torch.ones(100_000), "later": Unpicklable()}, path)
    assert path.read_bytes() == good  # never touched: the new bytes went to the partial file
    assert not partial_path(path).exists()  # and the partial file was removed
    assert io.load_checkpoint(path)["step"] == 1


def test_resume_picks_last_ckpt_and_never_a_partial_file(tmp_path):
    assert resume_checkpoint(tmp_path / "missing", resume=True) is None
    tmp_path.joinpath(".last.ckpt.partial").write_bytes(b"torn")
    assert resume_checkpoint(tmp_path, resume=True) is None  # a leftover alone is no checkpoint
    assert resume_checkpoint(tmp_path, resume=False) is None  # nor is it an earlier run to refuse
    AtomicCheckpointIO().save_checkpoint({"step": 3}, tmp_path / "last.ckpt")
    assert resume_checkpoint(tmp_path, resume=True) == str(tmp_path / "last.ckpt")


def test_starting_afresh_over_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """resume=false where an earlier run's complete checkpoints are: its last.ckpt would stay until this run's first
    save, and a crash before it plus a plain relaunch would continue the earlier run. Refused, naming the directory,
    the newest checkpoint and the ways out; nothing is touched. A file that is not this recipe's is no run."""
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "someone_elses.ckpt")
    assert resume_checkpoint(tmp_path, resume=False) is None
    for name in ("step_4.ckpt", "step_12.ckpt", "step_8.ckpt", "last.ckpt"):
        io.save_checkpoint({"step": 1}, tmp_path / name)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError) as refused:
        resume_checkpoint(tmp_path, resume=False)
    message = str(refused.value)
    assert f"checkpoint.ckpt_dir={tmp_path} " in message and f"newest: {tmp_path / 'last.ckpt'})" in message, message
    assert "last.ckpt, step_12.ckpt, step_8.ckpt, step_4.ckpt" in message and "someone" not in message, message
    for way_out in ("checkpoint.resume=true", "new output_dir", "delete"):
        assert way_out in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert resume_checkpoint(tmp_path, resume=True) == str(tmp_path / "last.ckpt")


def test_without_last_ckpt_a_resume_takes_the_newest_step_file(tmp_path, caplog):
    """A job killed between its first step_<N>.ckpt and last.ckpt: the relaunch continues that step file (step 12, not
    the lexically last step_8), not a new run beside it."""
    for name in ("step_4.ckpt", "step_12.ckpt", "step_8.ckpt"):
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / name)
    assert resume_checkpoint(tmp_path, resume=True) == str(tmp_path / "step_12.ckpt")
    assert "No last.ckpt" in caplog.text


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, max_steps: int, **checkpoint_kwargs) -> list[str]:
    callback = RecipeModelCheckpoint(dirpath=str(tmp_path), **checkpoint_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, callbacks=[callback], plugins=[AtomicCheckpointIO()], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=4))
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "files", "last_step"),
    [
        ({"save_every": 2, "keep": 1, "save_final": True}, ["last.ckpt", "step_4.ckpt"], 5),  # final step 5 too
        ({"save_every": 2, "keep": 0, "save_final": False}, ["last.ckpt"], 4),
        ({"save_every": 2, "keep": -1, "save_final": True}, ["last.ckpt", "step_2.ckpt", "step_4.ckpt"], 5),
        ({"save_every": 0, "keep": 0, "save_final": True}, ["last.ckpt"], 5),
    ],
)
def test_model_checkpoint_saves_every_n_steps_and_the_final_step(tmp_path, kwargs, files, last_step):
    assert fit(tmp_path, 5, **kwargs) == files
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == last_step


class TELikeLinear(torch.nn.Linear):
    """A linear layer whose extra state behaves as TE's does: saved as a byte tensor, and anything but a tensor,
    ``io.BytesIO`` or None refused on load (TE's "Unsupported checkpoint format")."""

    def __init__(self):
        super().__init__(4, 4)
        self.fp8_bookkeeping = torch.tensor([7], dtype=torch.uint8)

    def get_extra_state(self) -> torch.Tensor:
        return self.fp8_bookkeeping

    def set_extra_state(self, state) -> None:
        if state is not None and not isinstance(state, torch.Tensor | io.BytesIO):
            raise RuntimeError("Unsupported checkpoint format.")
        self.fp8_bookkeeping = state


def test_an_fsdp2_resume_loads_weights_only_checkpoints_into_te_modules(tmp_path):
    """The load ModelParallelStrategy does (set_model_state_dict, whole state from rank 0, not strict) of a checkpoint
    without `_extra_state` (as on_save_checkpoint writes them): torch hands TE modules a placeholder, which they
    refuse; inside extra_state_kept_when_absent the weights load and each module keeps its own extra state."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        saved = torch.nn.Sequential(TELikeLinear(), TELikeLinear())
        weights_only = {k: v for k, v in saved.state_dict().items() if not k.endswith("_extra_state")}
        model = torch.nn.Sequential(TELikeLinear(), TELikeLinear())
        model[0].fp8_bookkeeping = torch.tensor([3], dtype=torch.uint8)  # this run's own, to be kept
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)

        # torch 2.13's behaviour this works around (if it stops raising, the workaround can go).
        with pytest.raises(RuntimeError, match="Unsupported checkpoint format"):
            set_model_state_dict(model, dict(weights_only), options=options)

        with extra_state_kept_when_absent(model):
            set_model_state_dict(model, dict(weights_only), options=options)
        for key, value in weights_only.items():
            torch.testing.assert_close(model.state_dict()[key].full_tensor(), value, rtol=0, atol=0, msg=key)
        assert model[0].fp8_bookkeeping.tolist() == [3] and model[1].fp8_bookkeeping.tolist() == [7]
        assert "set_extra_state" not in vars(model[0])  # the modules are as before outside the block
    finally:
        dist.destroy_process_group()
