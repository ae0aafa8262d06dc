"""How many processes the Trainer is told it has: from torchrun, from SLURM (slurm.sh's launch), or one; the
strategy each `strategy=` value builds; and how a finished run's process ends (``end_run``)."""

import subprocess
import textwrap

import pytest
from launch import RECIPE_DIR, run_script
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from omegaconf import OmegaConf
from trainer_setup import build_strategy, process_counts
from user_errors import ConfigError


AUTO = OmegaConf.create({"devices": "auto", "num_nodes": "auto"})
LAUNCH_VARIABLES = ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NAME")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_plain_python_is_one_process_whatever_the_gpu_count(no_launcher):
    assert process_counts(AUTO) == (1, 1)


def test_torchrun_counts(no_launcher):
    no_launcher.setenv("LOCAL_WORLD_SIZE", "4")
    no_launcher.setenv("WORLD_SIZE", "8")
    assert process_counts(AUTO) == (4, 2)


def test_slurm_counts_as_slurm_sh_launches(no_launcher):
    """slurm.sh: 2 nodes x 8 tasks (one per GPU), Lightning's SLURM launch; an explicit setting still wins."""
    no_launcher.setenv("SLURM_NTASKS", "16")
    no_launcher.setenv("SLURM_NNODES", "2")
    no_launcher.setenv("SLURM_JOB_NAME", "codonfm_ptl_te")  # Lightning treats a job named "bash" as interactive
    assert process_counts(AUTO) == (8, 2)
    assert process_counts(OmegaConf.create({"devices": 2, "num_nodes": 1})) == (2, 1)


def test_slurm_script_parses_and_uses_a_shipped_config():
    script = RECIPE_DIR / "slurm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "--ntasks-per-node=8" in text and "--gpus-per-node=8" in text  # one task per GPU
    config = text.split("CONFIG_NAME=${CONFIG_NAME:-")[1].split("}")[0]
    assert (RECIPE_DIR / "hydra_config" / f"{config}.yaml").is_file()


def test_strategies():
    cfg = OmegaConf.create(
        {"strategy": "ddp", "trainer": {"precision": "32-true"}, "fsdp": {"reshard_after_forward": True}}
    )
    assert build_strategy(cfg, "cpu", 1, 1) == "auto"  # one device: no DDP wrapper
    assert isinstance(build_strategy(cfg, "cpu", 2, 1), DDPStrategy)
    cfg.strategy = "fsdp2"
    assert isinstance(build_strategy(cfg, "cpu", 2, 2), ModelParallelStrategy)


def test_activation_recompute_is_refused_with_fsdp1():
    """Not tested with FSDP1's per-layer wrappers: refused by name before anything is built (also on CPU)."""
    cfg = OmegaConf.create(
        {
            "strategy": "fsdp",
            "trainer": {"precision": "32-true"},
            "fsdp": {"reshard_after_forward": True},
            "model_config_overrides": {"recompute_layers": 2},
        }
    )
    with pytest.raises(ConfigError, match="recompute_layers is not supported with strategy=fsdp"):
        build_strategy(cfg, "cpu", 2, 1)


# A script that ends like train.py and predict.py, then marks that the code after end_run() ran.
END_RUN_SCRIPT = """
    import sys

    import torch.distributed as dist
    from trainer_setup import end_run

    if len(sys.argv) > 2 and sys.argv[2] == "group":
        dist.init_process_group("gloo")
    end_run()
    rank = dist.get_rank() if dist.is_initialized() else 0
    open(f"{sys.argv[1]}/after_end_run_{rank}", "w").close()
"""


def test_end_run_leaves_a_multi_process_cpu_run_at_once(tmp_path):
    """Two gloo ranks: both meet, and the process exits with status 0 before the code after end_run() (and the
    interpreter's teardown, where a CI run once aborted) could run."""
    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent(END_RUN_SCRIPT))
    run_script(script, str(tmp_path), "group", nproc=2, timeout=120)  # raises unless both ranks exit 0
    assert not list(tmp_path.glob("after_end_run_*"))


def test_end_run_returns_without_a_process_group(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent(END_RUN_SCRIPT))
    run_script(script, str(tmp_path), timeout=120)
    assert (tmp_path / "after_end_run_0").exists()
