"""The shipped Hydra configs and what model_setup makes of them: documented keys only, files that exist, the model
shapes the issue asks for, the FP8 layer list with the first and last layers in bf16
(``fp8_config.keep_first_last_bf16``, resolved by ``quantization.build_quantization``), and clear config errors."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import quantization
import torch
from dataset import DEFAULTS
from hydra import compose, initialize_config_dir
from mixed_precision import mixed_precision_policy
from model_setup import load_model_config
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError


CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_config"
RECIPE_DIR = CONFIG_DIR.parent
NAMED_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "defaults")
OG2_CONFIGS = ["og2_1b_thd", "og2_7b_thd_gqa", "og2_7b_thd_gqa_fp8", "og2_7b_thd_gqa_global_shuffle"]
# TE is not needed for an FP8 plan on CPU: this stands in for the recipe TE would build (it answers delayed() as
# TE's block-scaling recipe does).
FP8_RECIPE = SimpleNamespace(delayed=lambda: False)


def compose_config(name: str, overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=["output_dir=unused", *overrides])


def strict_defaults():
    defaults = OmegaConf.load(CONFIG_DIR / "defaults.yaml")
    defaults.pop("defaults")
    defaults.pop("hydra")
    OmegaConf.set_struct(defaults, True)
    for open_key in ("model_config_overrides", "fp8_config.fp8_recipe_kwargs", "fp4_config.fp4_recipe_kwargs"):
        OmegaConf.set_struct(OmegaConf.select(defaults, open_key), False)
    return defaults


def test_expected_configs_ship():
    assert {"L0_sanity", *OG2_CONFIGS} <= set(NAMED_CONFIGS)


def test_defaults_document_every_dataset_key():
    assert set(OmegaConf.load(CONFIG_DIR / "defaults.yaml").dataset) == set(DEFAULTS)


@pytest.mark.parametrize("name", NAMED_CONFIGS)
def test_config_uses_only_documented_keys(name):
    """Hydra's struct mode guards command-line overrides; a typo inside a YAML file would be merged in silently."""
    cfg = compose_config(name)
    OmegaConf.merge(strict_defaults(), OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))


def test_a_typo_in_a_config_file_is_caught():
    with pytest.raises(ConfigKeyError, match="window_overlapp"):
        OmegaConf.merge(strict_defaults(), OmegaConf.create({"dataset": {"window_overlapp": 4}}))


@pytest.mark.parametrize("name", OG2_CONFIGS)
def test_og2_configs_ask_for_their_data(name):
    cfg = compose_config(name)
    assert OmegaConf.is_missing(cfg.dataset, "path") and OmegaConf.is_missing(cfg.validation, "path")
    assert (cfg.dataset.max_seq_length, cfg.dataset.window_overlap, cfg.dataset.input_format) == (8192, 200, "thd")


def test_global_shuffle_reads_parquet_shards():
    assert compose_config("og2_7b_thd_gqa_global_shuffle").dataset.format == "parquet"


def test_l0_sanity_is_complete_and_uses_shipped_data():
    cfg = compose_config("L0_sanity")
    OmegaConf.to_container(cfg, resolve=False, throw_on_missing=True)
    assert len(list(RECIPE_DIR.glob(cfg.dataset.path))) == 2 and (RECIPE_DIR / cfg.validation.path).is_file()


def _model_config(name: str, *overrides: str):
    return load_model_config(compose_config(name, overrides))[0]


def test_og2_7b_shape_and_stability_switches():
    config = _model_config("og2_7b_thd_gqa")
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (32, 4096, 32, 8)
    assert (config.intermediate_size, config.rope_parameters["rope_theta"], config.vocab_size) == (
        14336,
        500000.0,
        256,
    )
    assert config.embedding_init_std == 1.0 and config.scale_output_projection_init and not config.tie_word_embeddings


def test_og2_1b_is_the_llama_3_2_1b_shape_untied_with_plain_rope():
    config = _model_config("og2_1b_thd")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (16, 2048, 8192)
    assert (config.num_attention_heads, config.num_key_value_heads) == (32, 8)
    assert config.rope_parameters["rope_type"] == "default" and not config.tie_word_embeddings
    assert config.embedding_init_std == 1.0 and config.scale_output_projection_init
    assert config.fused_residual_norm  # switched off for FP8 runs (test_model_setup.py)


def _fp8_layer_plan(monkeypatch, layers: int, keep: int):
    """load_model_config of L0_sanity with ``layers`` layers, FP8 on and ``keep_first_last_bf16=keep``. TE is not
    needed for the plan (FP8_RECIPE stands in)."""
    monkeypatch.setattr(quantization, "build_recipe", lambda *args: FP8_RECIPE)
    overrides = [f"+model_config_overrides.num_hidden_layers={layers}", "fp8_config.enabled=true"]
    return load_model_config(compose_config("L0_sanity", [*overrides, f"fp8_config.keep_first_last_bf16={keep}"]))


@pytest.mark.parametrize(
    ("layers", "keep", "expected"), [(32, 2, list(range(3, 31))), (4, 1, [2, 3]), (3, 0, [1, 2, 3])]
)
def test_keep_first_last_bf16_layer_list(monkeypatch, layers, keep, expected):
    config, plan = _fp8_layer_plan(monkeypatch, layers, keep)
    assert config.layer_precision == ["fp8" if number in expected else None for number in range(1, layers + 1)]
    assert plan.fp8_recipe is FP8_RECIPE


@pytest.mark.parametrize(("layers", "keep"), [(4, 2), (3, 2), (8, -1)])
def test_keep_first_last_bf16_rejects_impossible_values(monkeypatch, layers, keep):
    with pytest.raises(ValueError, match="keep_first_last_bf16"):
        _fp8_layer_plan(monkeypatch, layers, keep)


def test_fp8_config_keeps_the_first_and_last_two_layers_in_bf16(monkeypatch):
    """og2_7b_thd_gqa_fp8 as shipped: layers 3..30 in FP8. TE is not needed for the plan (FP8_RECIPE stands in)."""
    monkeypatch.setattr(quantization, "build_recipe", lambda *args: FP8_RECIPE)
    config, plan = load_model_config(compose_config("og2_7b_thd_gqa_fp8"))
    assert config.layer_precision == [None, None] + ["fp8"] * 28 + [None, None]
    assert plan.fp8_recipe is FP8_RECIPE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fp8_config.keep_first_last_bf16=1"], "fp8_config.enabled is false"),
        (["fp8_config.enabled=true", "fp8_config.keep_first_last_bf16=1", "fp8_config.fp8_layers=[1]"], "not both"),
        (["+model_config_overrides.hidden_sise=64"], "hidden_sise"),
        (["model_config_overrides.tie_word_embeddings=true"], "needs untied embeddings"),
    ],
)
def test_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_model_config(compose_config("L0_sanity", overrides))


def test_mixed_precision_policy_keeps_fp32_masters_and_reduction():
    cfg = compose_config("L0_sanity", ["mixed_precision.on_cpu=true"])
    policy = mixed_precision_policy(cfg.mixed_precision, torch.device("cpu"))
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    fp32 = mixed_precision_policy(compose_config("L0_sanity").mixed_precision, torch.device("cpu"))  # bf16 is opt-in
    assert fp32.param_dtype is None and not fp32.cast_forward_inputs


@pytest.mark.parametrize(
    ("name", "expected"), [("og2_1b_thd", ("DelayedScaling", "HYBRID")), ("L0_sanity", ("Float8BlockScaling", "E4M3"))]
)
def test_fp8_on_og2_1b_is_delayed_scaling_with_e5m2_gradients(monkeypatch, name, expected):
    """``fp8_config.enabled=true`` on og2_1b_thd builds DelayedScaling with HYBRID (E5M2 gradients), the fastest
    Hopper FP8 recipe measured at that shape (docs/benchmarks.md), with its scales set before step 1; other configs
    keep the defaults' Float8BlockScaling. A stand-in for TE's recipe records what was asked."""
    built = []

    def record_recipe(recipe_name, fp8_format, kwargs, allowed):
        built.append((recipe_name, fp8_format, dict(kwargs or {})))
        return SimpleNamespace(delayed=lambda: recipe_name == "DelayedScaling")

    monkeypatch.setattr(quantization, "build_recipe", record_recipe)
    cfg = compose_config(name, ["fp8_config.enabled=true"])
    load_model_config(cfg)
    assert built == [(*expected, {})]
    assert cfg.fp8_config.calibrate_delayed_scaling
