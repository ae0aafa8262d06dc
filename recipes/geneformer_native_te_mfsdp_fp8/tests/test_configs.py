"""The shipped Hydra configs: each composes, uses only keys that defaults.yaml documents, points at files that exist,
and runs to the end (final checkpoint and export) and resumes from there. Hydra's struct mode only guards
command-line overrides; a typo inside a YAML file would otherwise be merged in silently and ignored."""

import json
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launch import run_script
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError


CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_config"
RECIPE_DIR = CONFIG_DIR.parent
# The training configs; embed.yaml is embed.py's own, with its own keys (tests/test_embed.py runs it).
NAMED_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem not in ("defaults", "embed"))
# The benchmark shapes shrunk to CPU size; what the test checks is the config's plumbing (keys, data settings,
# schedule, checkpoint and export), which does not depend on the width.
SHRUNK = (
    "++model_config_overrides={num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, num_attention_heads: 2}"
)


def _compose(name: str, overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _strict_defaults():
    defaults = OmegaConf.load(CONFIG_DIR / "defaults.yaml")
    defaults.pop("defaults")
    defaults.pop("hydra")
    OmegaConf.set_struct(defaults, True)
    # Free-form by design; their keys are checked at run time against the model config and the TE recipe.
    for open_key in ("model_config_overrides", "fp8_config.fp8_recipe_kwargs", "fp4_config.fp4_recipe_kwargs"):
        OmegaConf.set_struct(OmegaConf.select(defaults, open_key), False)
    return defaults


def test_expected_configs_ship():
    assert {"L0_sanity", "10m", "106m", "4b"} <= set(NAMED_CONFIGS)


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_config_uses_only_documented_keys(name):
    cfg = _compose(name)
    cfg_values = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.merge(_strict_defaults(), cfg_values)  # raises ConfigKeyError on a key defaults.yaml lacks


def test_a_typo_in_a_config_file_is_caught():
    with pytest.raises(ConfigKeyError, match="micro_batchsize"):
        OmegaConf.merge(_strict_defaults(), OmegaConf.create({"dataset": {"micro_batchsize": 4}}))


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_model_config_exists(name):
    assert (RECIPE_DIR / _compose(name).model_tag / "config.json").is_file()


def test_l0_sanity_is_complete_and_uses_shipped_data():
    cfg = _compose("L0_sanity", ["output_dir=unused"])
    assert not [key for key in ("model_tag", "num_train_steps", "dataset.path") if OmegaConf.is_missing(cfg, key)]
    assert (RECIPE_DIR / cfg.dataset.path).is_file()
    assert (RECIPE_DIR / cfg.validation.path).is_file()  # the shipped held-out cells


@pytest.mark.parametrize("name", ["10m", "106m", "4b"])
def test_benchmarks_ask_for_their_data(name):
    cfg = _compose(name)
    assert OmegaConf.is_missing(cfg.dataset, "path")  # real data is not shipped in the repo
    assert cfg.dataset.max_seq_length == 2048 and cfg.dataset.token_budget % 2048 == 0


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_every_config_finishes_and_resumes(tmp_path, name):
    """Each config runs 2 steps to a final checkpoint and export, then a second launch with 3 steps resumes at
    step 2 (not from scratch) and finishes again."""
    args = ["--config-name", name, f"output_dir={tmp_path}", "dataset.path=data/sanity_cells.parquet", SHRUNK]
    args += ["dataset.max_seq_length=256", "dataset.token_budget=1024", "dataset.num_workers=0", "logger.log_every=1"]
    run_script("train_fsdp2.py", *args, "num_train_steps=2")
    assert (tmp_path / "checkpoints" / "step_2").is_dir() and (tmp_path / "final_model" / "config.json").is_file()
    result = run_script("train_fsdp2.py", *args, "num_train_steps=3")
    assert "Resumed from" in result.stdout + result.stderr, (result.stdout + result.stderr)[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step_3").is_dir()
    assert json.loads((tmp_path / "final_model" / "config.json").read_text())["hidden_size"] == 64


def test_slurm_script_parses():
    """slurm.sh is an example to adapt (no cluster here): at least it must be valid bash."""
    result = subprocess.run(["bash", "-n", str(RECIPE_DIR / "slurm.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
