"""The shipped Hydra configs: each composes, uses only keys that defaults.yaml documents, and points at files that
exist. Hydra's struct mode only guards command-line overrides; a typo inside a YAML file would otherwise be merged
in silently and ignored."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError


CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_config"
RECIPE_DIR = CONFIG_DIR.parent
# The training configs; predict.yaml is predict.py's own, with its own keys (tests/test_predict.py runs it).
NAMED_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem not in ("defaults", "predict"))


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
    assert {"L0_sanity", "L0_sanity_cp", "L1_650M", "L1_3B", "L1_15B_perf"} <= set(NAMED_CONFIGS)


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_config_uses_only_documented_keys(name):
    cfg = _compose(name)
    cfg_values = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.merge(_strict_defaults(), cfg_values)  # raises ConfigKeyError on a key defaults.yaml lacks


def test_a_typo_in_a_config_file_is_caught():
    typo = OmegaConf.create({"dataset": {"micro_batchsize": 4}})
    with pytest.raises(ConfigKeyError, match="micro_batchsize"):
        OmegaConf.merge(_strict_defaults(), typo)


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_model_config_exists(name):
    assert (RECIPE_DIR / _compose(name).model_tag / "config.json").is_file()


@pytest.mark.parametrize("name", ["L0_sanity", "L0_sanity_cp"])
def test_l0_configs_are_complete_and_use_shipped_data(name):
    cfg = _compose(name, ["output_dir=unused"])
    missing = [key for key in ("model_tag", "num_train_steps", "dataset.path") if OmegaConf.is_missing(cfg, key)]
    assert not missing
    assert (RECIPE_DIR / cfg.dataset.path).is_file()


@pytest.mark.parametrize("name", ["L1_650M", "L1_3B", "L1_15B_perf", "L1_amplify_120M", "L1_amplify_350M"])
def test_benchmarks_ask_for_their_data(name):
    assert OmegaConf.is_missing(_compose(name).dataset, "path")  # real data is not shipped in the repo


def test_keep_first_last_bf16_reaches_the_quantization_plan():
    """The key defaults.yaml documents is read by the plan: set without FP8 enabled, it is refused by name."""
    from model_families import load_model_config

    assert _compose("L0_sanity", ["output_dir=unused"]).fp8_config.keep_first_last_bf16 == 0
    cfg = _compose("L0_sanity", ["fp8_config.keep_first_last_bf16=1", "output_dir=unused"])
    with pytest.raises(ValueError, match="keep_first_last_bf16 is set but fp8_config.enabled is false"):
        load_model_config(cfg, cfg.fp8_config, cfg.fp4_config)


def test_recomputed_fp8_layers_with_delayed_scaling_are_planned(monkeypatch):
    """DelayedScaling layers may be recomputed (activation_recompute.py keeps its once-per-step scale updates; the
    models' GPU contract checks the gradients and amax histories). The plan is built with TE's recipe on a GPU
    machine; here a stand-in that answers ``delayed()`` like it."""
    import model_families
    from quantization import QuantizationPlan

    class Delayed:
        @classmethod
        def delayed(cls) -> bool:
            return True

    plan = QuantizationPlan([None, "fp8", "fp8", "fp8", "fp8", None], fp8_recipe=Delayed())
    monkeypatch.setattr(model_families, "build_quantization", lambda *args: plan)
    overrides = ["fp8_config.enabled=true", "output_dir=unused", "+model_config_overrides.recompute_layers=3"]
    cfg = _compose("L0_sanity", overrides)
    config = model_families.load_model_config(cfg, cfg.fp8_config, cfg.fp4_config)[0]
    assert (config.recompute_layers, config.layer_precision) == (3, plan.layer_precision)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("L1_650M", "DelayedScaling"), ("L1_3B", "DelayedScaling"), ("L0_sanity", "Float8BlockScaling")],
)
def test_fp8_on_the_benchmark_configs_is_delayed_scaling(monkeypatch, name, expected):
    """``fp8_config.enabled=true`` on the 650M and 3B configs builds DelayedScaling (E4M3), the fastest Hopper FP8
    recipe measured at their shapes (docs/benchmarks.md), with its scales set before step 1; other configs keep the
    defaults' Float8BlockScaling. The recipe object is TE's on a GPU machine; here a stand-in records what was asked."""
    import model_families
    import quantization

    built = []

    def record_recipe(recipe_name, fp8_format, kwargs, allowed):
        built.append((recipe_name, fp8_format, dict(kwargs or {})))
        return SimpleNamespace(delayed=lambda: recipe_name == "DelayedScaling")

    monkeypatch.setattr(quantization, "build_recipe", record_recipe)
    cfg = _compose(name, ["fp8_config.enabled=true", "output_dir=unused"])
    model_families.load_model_config(cfg, cfg.fp8_config, cfg.fp4_config)
    assert built == [(expected, "E4M3", {})]
    assert cfg.fp8_config.calibrate_delayed_scaling
