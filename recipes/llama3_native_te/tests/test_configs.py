"""The shipped Hydra configs: each composes, uses only keys that defaults.yaml documents, points at files that
exist, and the data-config keys match what dataset.py accepts. Hydra's struct mode only guards command-line
overrides; a typo inside a YAML file would otherwise be merged in silently and ignored."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from dataset import DEFAULTS
from hydra import compose, initialize_config_dir
from model_setup import load_model_config
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError


CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_config"
RECIPE_DIR = CONFIG_DIR.parent
NAMED_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "defaults")


def _compose(name: str, overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _strict_defaults():
    defaults = OmegaConf.load(CONFIG_DIR / "defaults.yaml")
    defaults.pop("defaults")
    defaults.pop("hydra")
    OmegaConf.set_struct(defaults, True)
    for open_key in ("model_config_overrides", "fp8_config.fp8_recipe_kwargs", "fp4_config.fp4_recipe_kwargs"):
        OmegaConf.set_struct(OmegaConf.select(defaults, open_key), False)
    return defaults


def test_expected_configs_ship():
    expected = {"L0_sanity", "L0_sanity_cp", "L0_convergence", "L1_1B_perf", "L1_8B_perf", "L2_lingua_1b"}
    assert expected <= set(NAMED_CONFIGS)


def test_defaults_document_every_dataset_key():
    assert set(OmegaConf.load(CONFIG_DIR / "defaults.yaml").dataset) == set(DEFAULTS)


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_config_uses_only_documented_keys(name):
    cfg = _compose(name)
    OmegaConf.merge(_strict_defaults(), OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))


def test_a_typo_in_a_config_file_is_caught():
    with pytest.raises(ConfigKeyError, match="window_overlapp"):
        OmegaConf.merge(_strict_defaults(), OmegaConf.create({"dataset": {"window_overlapp": 4}}))


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_model_config_exists(name):
    assert (RECIPE_DIR / _compose(name).model_tag / "config.json").is_file()


@pytest.mark.parametrize("name", ["L0_sanity", "L0_sanity_cp", "L0_convergence"])
def test_l0_configs_are_complete_and_use_shipped_data(name):
    cfg = _compose(name, ["output_dir=unused"])
    assert not [key for key in ("model_tag", "num_train_steps", "dataset.path") if OmegaConf.is_missing(cfg, key)]
    assert (RECIPE_DIR / cfg.dataset.path).is_file()
    if name.startswith("L0_sanity"):  # held-out sequences of the same chain, scored during the run
        assert (RECIPE_DIR / cfg.validation.path).is_file() and cfg.validation.path != cfg.dataset.path


@pytest.mark.parametrize("name", ["L1_1B_perf", "L1_8B_perf", "L2_lingua_1b"])
def test_benchmarks_ask_for_their_data(name):
    assert OmegaConf.is_missing(_compose(name).dataset, "path")


def test_lingua_asks_for_tokenizer_and_vocabulary():
    cfg = _compose("L2_lingua_1b")
    assert OmegaConf.is_missing(cfg, "tokenizer_path")
    assert OmegaConf.is_missing(cfg.model_config_overrides, "vocab_size")


def test_l1_1b_shape():
    cfg = _compose("L1_1B_perf")
    assert cfg.dataset.max_seq_length == 8192 and cfg.dataset.input_format == "thd"
    assert cfg.dataset.token_budget * cfg.grad_acc_steps == 32768  # issue 12's tokens per GPU per step
    assert cfg.model_config_overrides.fused_residual_norm  # switched off for FP8 runs (test_model_setup.py)
    config = OmegaConf.load(RECIPE_DIR / cfg.model_tag / "config.json")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (2048, 16, 256)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here")
def test_fp8_without_transformer_engine_fails_clearly():
    with pytest.raises(ImportError, match="TransformerEngine is not installed"):
        load_model_config(_compose("L0_sanity", ["fp8_config.enabled=true", "output_dir=unused"]))


def test_unknown_model_override_fails():
    cfg = _compose("L0_sanity", ["+model_config_overrides.hidden_sise=64", "output_dir=unused"])
    with pytest.raises(ValueError, match="hidden_sise"):
        load_model_config(cfg)


def test_keep_first_last_bf16_reaches_the_quantization_plan():
    """The key defaults.yaml documents is read by the plan: set without FP8 enabled, it is refused by name."""
    assert _compose("L0_sanity", ["output_dir=unused"]).fp8_config.keep_first_last_bf16 == 0
    cfg = _compose("L0_sanity", ["fp8_config.keep_first_last_bf16=1", "output_dir=unused"])
    with pytest.raises(ValueError, match="keep_first_last_bf16 is set but fp8_config.enabled is false"):
        load_model_config(cfg)


@pytest.mark.parametrize(
    ("name", "expected"), [("L1_1B_perf", ("DelayedScaling", "HYBRID")), ("L0_sanity", ("Float8BlockScaling", "E4M3"))]
)
def test_fp8_on_the_1b_benchmark_is_delayed_scaling_with_e5m2_gradients(monkeypatch, name, expected):
    """``fp8_config.enabled=true`` on L1_1B_perf builds DelayedScaling with HYBRID (E5M2 gradients), the fastest
    Hopper FP8 recipe measured at that shape (docs/benchmarks.md), with its scales set before step 1; other configs keep
    the defaults' Float8BlockScaling. The recipe object is TE's on a GPU machine; here a stand-in records what was
    asked."""
    import quantization

    built = []

    def record_recipe(recipe_name, fp8_format, kwargs, allowed):
        built.append((recipe_name, fp8_format, dict(kwargs or {})))
        return SimpleNamespace(delayed=lambda: recipe_name == "DelayedScaling")

    monkeypatch.setattr(quantization, "build_recipe", record_recipe)
    cfg = _compose(name, ["fp8_config.enabled=true", "output_dir=unused"])
    load_model_config(cfg)
    assert built == [(*expected, {})]
    assert cfg.fp8_config.calibrate_delayed_scaling
