"""The FP8 recipe each shipped config asks TransformerEngine for when ``fp8_config.enabled=true``."""

from types import SimpleNamespace

import pytest
import quantization
from hydra import compose, initialize_config_dir
from launch import RECIPE_DIR
from model_setup import load_model_config


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("encodon_600m", ("DelayedScaling", "HYBRID")),
        ("encodon_80m", ("Float8BlockScaling", "E4M3")),
        ("L0_sanity", ("Float8BlockScaling", "E4M3")),
    ],
)
def test_fp8_on_encodon_600m_is_delayed_scaling_with_e5m2_gradients(monkeypatch, name, expected):
    """encodon_600m builds DelayedScaling with HYBRID (E5M2 gradients), the fastest Hopper FP8 recipe measured at that
    shape (docs/benchmarks.md), with its scales set before step 1; the others keep the defaults' Float8BlockScaling.
    A stand-in for TE's recipe records what was asked (TE builds it on a GPU machine)."""
    built = []

    def record_recipe(recipe_name, fp8_format, kwargs, allowed):
        built.append((recipe_name, fp8_format, dict(kwargs or {})))
        return SimpleNamespace(delayed=lambda: recipe_name == "DelayedScaling")

    monkeypatch.setattr(quantization, "build_recipe", record_recipe)
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        cfg = compose(config_name=name, overrides=["output_dir=unused", "fp8_config.enabled=true"])
    load_model_config(cfg)
    assert built == [(*expected, {})]
    assert cfg.fp8_config.calibrate_delayed_scaling
