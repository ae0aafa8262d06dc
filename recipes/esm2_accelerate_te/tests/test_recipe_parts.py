"""The parts train.py puts together, each against a reference that does not use it: the loss over micro-batches, the
checkpoint bookkeeping, and the one-line refusals of what a launch cannot do."""

import itertools
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from checkpoints import (
    MARKER,
    checkpoint_step,
    clear_for_save,
    find_resume_checkpoint,
    mark_complete,
    prune_checkpoints,
    restore_data_position,
    resume_checkpoint,
    save_data_position,
)
from epoch_batch_sampler import EpochBatchSampler
from hydra import compose, initialize_config_dir
from launch import RECIPE_DIR
from launch_settings import LaunchSettings, check_launch, fp8_config_from_accelerate
from mlm_trainer import masked_lm_loss
from torchdata.stateful_dataloader import StatefulDataLoader
from training_arguments import training_arguments
from transformers.modeling_outputs import MaskedLMOutput
from user_errors import ConfigError, UnsupportedHardwareError


def _compose(name: str = "L0_sanity", overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        return compose(config_name=name, overrides=["output_dir=unused", *(overrides or [])])


def _launch(**kwargs) -> LaunchSettings:
    defaults = {"precision": "bf16", "fsdp": False, "fsdp_layer_class": None, "use_cpu": False, "launched": True}
    return LaunchSettings(**{**defaults, **kwargs})


# ------------------------------------------------------------------------------------------------ loss


def test_micro_batch_losses_add_up_to_the_token_mean_of_the_whole_step():
    """Two micro-batches with different numbers of masked tokens: the summed losses (each divided by the step's
    count, as the Trainer passes it) equal the token-mean cross-entropy of one batch holding both."""
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 33)
    labels = torch.full((2, 7), -100)
    labels[0, 1], labels[1, [0, 2, 3, 5]] = 4, torch.tensor([5, 6, 7, 8])
    total = int((labels != -100).sum())
    parts = [masked_lm_loss(MaskedLMOutput(logits=logits[i : i + 1]), labels[i : i + 1], total) for i in range(2)]
    reference = F.cross_entropy(logits.reshape(-1, 33), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(sum(parts), reference)
    # Without a count (evaluation) a batch is its own token mean.
    torch.testing.assert_close(masked_lm_loss(MaskedLMOutput(logits=logits), labels), reference)


# ------------------------------------------------------------------------------------------------ checkpoints


def _checkpoint(root, step, complete=True):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        mark_complete(path)
    return path


def test_resume_skips_a_checkpoint_whose_save_did_not_finish(tmp_path, caplog):
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 20, complete=False)  # killed during the save
    assert find_resume_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert "checkpoint-20" in caplog.text and MARKER in caplog.text
    assert find_resume_checkpoint(tmp_path / "missing") is None


def test_resume_from_names_one_checkpoint_which_must_be_complete(tmp_path):
    older = _checkpoint(tmp_path, 10)
    assert resume_checkpoint(True, str(older), tmp_path) == older and checkpoint_step(older) == 10
    _checkpoint(tmp_path, 20)
    assert resume_checkpoint(True, None, tmp_path) == tmp_path / "checkpoint-20"
    assert resume_checkpoint(True, str(tmp_path / "checkpoint-20"), tmp_path) == tmp_path / "checkpoint-20"
    unfinished = _checkpoint(tmp_path, 30, complete=False)
    with pytest.raises(ConfigError, match="did not finish"):
        resume_checkpoint(True, str(unfinished), tmp_path)
    with pytest.raises(ConfigError, match="not a checkpoint-<step> directory"):
        resume_checkpoint(True, str(tmp_path / "checkpoint-99"), tmp_path)


def test_starting_afresh_over_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """checkpoint.resume=false where complete checkpoints exist would rank, prune and overwrite them together with the
    new run's: refused, naming the directory, the newest checkpoint and the ways out. Nothing, or only incomplete
    directories (a killed save: never resumed), is no earlier run."""
    assert resume_checkpoint(False, None, tmp_path / "missing") is None
    _checkpoint(tmp_path, 8, complete=False)
    assert resume_checkpoint(False, None, tmp_path) is None
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    with pytest.raises(ConfigError) as refused:
        resume_checkpoint(False, None, tmp_path)
    message = str(refused.value)
    assert "checkpoint.resume=false" in message and f"output_dir={tmp_path} " in message, message
    assert str(tmp_path / "checkpoint-6") in message and "checkpoint-8" not in message, message
    for way_out in ("checkpoint.resume=true", "new output_dir", "delete"):
        assert way_out in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]  # nothing touched


def test_resume_from_an_older_checkpoint_while_newer_complete_ones_exist_is_refused(tmp_path):
    """Continuing checkpoint-4 while checkpoint-6 and -8 are complete would overwrite them (or prune them as the newest
    few), and a later plain resume would take the old run's -8: refused, naming them. A newer incomplete directory
    is no reason."""
    older = _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 6, complete=False)
    assert resume_checkpoint(True, str(older), tmp_path) == older
    _checkpoint(tmp_path, 8)
    with pytest.raises(ConfigError) as refused:
        resume_checkpoint(True, str(older), tmp_path)
    message = str(refused.value)
    assert f"checkpoint.resume_from={older}" in message and "checkpoint-8" in message, message
    assert "holds checkpoint-8 (" in message and "new output_dir" in message, message  # the newer ones only
    # From another directory's checkpoint, output_dir must hold no complete checkpoint at all.
    elsewhere = _checkpoint(tmp_path / "other_run", 10)
    with pytest.raises(ConfigError, match="checkpoint-8"):
        resume_checkpoint(True, str(elsewhere), tmp_path)
    assert resume_checkpoint(True, str(elsewhere), tmp_path / "new_dir") == elsewhere


def test_a_save_into_a_leftover_directory_clears_it_first(tmp_path):
    """Before the Trainer writes checkpoint-<step> where an earlier save left a directory, its marker and data
    positions go, so a save killed half-way cannot look complete or hold another run's positions."""
    leftover = _checkpoint(tmp_path, 4)
    save_data_position(leftover, 1, {"old": True})
    (leftover / "optimizer.pt").write_bytes(b"old")
    clear_for_save(leftover)
    assert not leftover.exists() and not find_resume_checkpoint(tmp_path)
    clear_for_save(tmp_path / "checkpoint-6")  # nothing there: nothing to do


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 25, complete=False)
    _checkpoint(tmp_path, 40, complete=False)  # a save in progress: never pruned
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-20", "checkpoint-30", "checkpoint-40"]
    prune_checkpoints(tmp_path, keep=None)  # keep all complete ones
    assert len(list(tmp_path.iterdir())) == 3


class _Loader:
    """A loader without a batch sampler (as the streaming loader): it only takes its state back."""

    batch_sampler = None

    def __init__(self):
        self.loaded = None

    def load_state_dict(self, state):
        self.loaded = state


class _EpochRows(torch.utils.data.Dataset):
    def __getitem__(self, key):  # the (epoch, row) the sampler hands out
        return key

    def __len__(self):
        return 50


def _sequence_loader(rank: int, world_size: int) -> StatefulDataLoader:
    sampler = EpochBatchSampler(np.arange(50), dp_rank=rank, dp_world_size=world_size, seed=3, micro_batch_size=4)
    return StatefulDataLoader(_EpochRows(), batch_sampler=sampler, collate_fn=lambda rows: rows)


def test_data_position_round_trip_and_a_different_process_count(tmp_path, caplog):
    checkpoint = _checkpoint(tmp_path, 5)
    for rank in (0, 1):
        save_data_position(checkpoint, rank, {"epoch": 1, "consumed": 16 + rank})
    loader = _Loader()
    restore_data_position(checkpoint, loader, 1, 2)
    assert loader.loaded == {"epoch": 1, "consumed": 17}
    with pytest.raises(ConfigError, match="written by 2 processes and its streaming data cannot continue on 4"):
        restore_data_position(checkpoint, _Loader(), 3, 4)

    # Map-style data on another number of processes: the epoch goes on with the rows neither process had read.
    checkpoint = _checkpoint(tmp_path, 6)
    read = []
    for rank in (0, 1):
        loader = _sequence_loader(rank, 2)
        batches = iter(loader)
        read += [row for _ in range(3) for _, row in next(batches)]
        save_data_position(checkpoint, rank, loader.state_dict())
    resumed = _sequence_loader(0, 1)
    restore_data_position(checkpoint, resumed, 0, 1)
    assert (
        "written by 2 processes, this run has 1" in caplog.text and "had read 24 of epoch 0's 50 rows" in caplog.text
    )
    rest = [row for batch in itertools.takewhile(lambda b: b[0][0] == 0, resumed) for _, row in batch]
    assert sorted(read + rest) == list(range(50))


# ------------------------------------------------------------------------------------------------ launch checks


def test_fsdp_on_cpu_is_refused():
    with pytest.raises(UnsupportedHardwareError, match="FSDP, which needs GPUs"):
        check_launch(_launch(fsdp=True, use_cpu=True), _compose(), capability=None)


def test_fp8_without_a_gpu_is_refused():
    with pytest.raises(UnsupportedHardwareError, match="fp8 needs an NVIDIA GPU"):
        check_launch(_launch(precision="fp8"), _compose(), capability=None)


@pytest.mark.parametrize(
    ("capability", "mxfp8", "message"),
    [
        ((8, 0), False, "FP8 needs a Ada/Hopper GPU or newer .* this one is 8.0"),
        ((9, 0), True, "MXFP8 needs a Blackwell"),
    ],
)
def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch, capability, mxfp8, message):
    monkeypatch.setenv("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING", str(mxfp8).lower())
    with pytest.raises(UnsupportedHardwareError, match=message):
        check_launch(_launch(precision="fp8"), _compose(), capability=capability)


def test_fp8_with_the_stock_model_is_refused():
    with pytest.raises(ConfigError, match="FP8 needs this recipe's TE model"):
        check_launch(_launch(precision="fp8"), _compose(overrides=["model_implementation=hf"]), capability=(9, 0))


def test_fp8_layers_without_an_fp8_launch_are_refused():
    with pytest.raises(ConfigError, match="does not ask for FP8"):
        check_launch(_launch(), _compose(overrides=["fp8_layers=[1]"]), capability=(9, 0))


@pytest.mark.parametrize(
    ("layer_class", "implementation", "advice"),
    [("EsmLayer", "nv", "fsdp2_te.yaml"), ("TransformerLayer", "hf", "fsdp2_hf.yaml")],
)
def test_fsdp_config_for_the_other_model_is_refused(layer_class, implementation, advice):
    cfg = _compose(overrides=[f"model_implementation={implementation}"])
    with pytest.raises(ConfigError, match=advice):
        check_launch(_launch(fsdp=True, fsdp_layer_class=layer_class), cfg, capability=(9, 0))


def test_launch_settings_come_from_accelerate_launch(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(key)
    assert LaunchSettings.from_environment().launched is False
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ConfigError, match="mixed_precision: fp16"):
        LaunchSettings.from_environment()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        LaunchSettings.from_environment()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "TransformerLayer")
    launch = LaunchSettings.from_environment()
    assert (launch.precision, launch.fsdp, launch.fsdp_layer_class) == ("bf16", True, "TransformerLayer")


def test_no_fp8_unless_the_launch_asks_for_it():
    assert fp8_config_from_accelerate(_launch(), _compose())["enabled"] is False


def test_fp8_delayed_scaling_with_gradient_checkpointing_is_accepted(monkeypatch):
    """accelerate's FP8 on Hopper is DelayedScaling, which the models recompute keeping its once-per-step scale
    updates (activation_recompute.py; the models' GPU contract checks it)."""
    import accelerate.utils

    accelerate_defaults = {  # accelerate's own TERecipeKwargs needs TE installed
        "use_mxfp8_block_scaling": False,
        "margin": 0,
        "amax_history_len": 1024,
        "amax_compute_algo": "most_recent",
        "override_linear_precision": (False, False, False),
        "fp8_format": "HYBRID",
    }
    monkeypatch.setattr(accelerate.utils, "TERecipeKwargs", lambda: SimpleNamespace(**accelerate_defaults))
    fp8 = _launch(precision="fp8")
    assert fp8_config_from_accelerate(fp8, _compose())["fp8_recipe"] == "DelayedScaling"
    checkpointing = _compose(overrides=["+training_args.gradient_checkpointing=true"])
    assert fp8_config_from_accelerate(fp8, checkpointing)["fp8_recipe"] == "DelayedScaling"


# ------------------------------------------------------------------------------------------------ TrainingArguments


def test_training_arguments_follow_the_hydra_config():
    cfg = _compose(overrides=["grad_acc_steps=2", "checkpoint.save_every=7", "adamw_kwargs.lr=1e-3"])
    args = training_arguments(cfg, _launch(precision="no", use_cpu=True))
    assert (args.max_steps, args.gradient_accumulation_steps, args.save_steps) == (150, 2, 7)
    assert (args.learning_rate, args.adam_beta2, args.bf16, args.ignore_data_skip) == (1e-3, 0.98, False, True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+training_args={max_steps: 3}", "which the recipe sets from its own keys"),
        ("+training_args={not_an_argument: 1}", "TrainingArguments does not have"),
        ("checkpoint.max_checkpoints=0", "max_checkpoints must be >= 1"),
        ("stop_after_steps=0", "stop_after_steps must be a positive step number"),
    ],
)
def test_bad_training_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        training_arguments(_compose(overrides=[override]), _launch(precision="no", use_cpu=True))


# ------------------------------------------------------------------------------------------------ recipe files


def test_slurm_script_parses_and_names_shipped_configs():
    import subprocess

    script = RECIPE_DIR / "slurm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "accelerate_config/fsdp2_te.yaml" in text and (RECIPE_DIR / "accelerate_config/fsdp2_te.yaml").is_file()
    assert (RECIPE_DIR / "hydra_config" / "L1_650M.yaml").is_file() and "CONFIG_NAME:-L1_650M" in text
