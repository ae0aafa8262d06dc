import dataclasses
import enum
import sys
import types

import pytest
from quantization import build_quantization, resolve_layer_precision


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, None),
        ({"fp8_enabled": True}, ["fp8"] * 4),
        ({"fp4_enabled": True}, ["fp4"] * 4),
        ({"fp8_enabled": True, "fp8_layers": [1, 4]}, ["fp8", None, None, "fp8"]),
        # Both enabled, one list given: the other format claims the rest.
        ({"fp8_enabled": True, "fp4_enabled": True, "fp8_layers": [1, 2]}, ["fp8", "fp8", "fp4", "fp4"]),
        ({"fp8_enabled": True, "fp4_enabled": True, "fp4_layers": [3]}, ["fp8", "fp8", "fp4", "fp8"]),
        # Both lists given: unlisted layers stay in bf16.
        ({"fp8_enabled": True, "fp4_enabled": True, "fp8_layers": [2], "fp4_layers": [4]}, [None, "fp8", None, "fp4"]),
    ],
)
def test_layer_assignment(kwargs, expected):
    assert resolve_layer_precision(4, **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fp8_enabled": True, "fp8_layers": [0]}, r"outside 1\.\.4 \(layers are 1-indexed\)"),
        ({"fp8_enabled": True, "fp8_layers": [5]}, r"outside 1\.\.4"),
        ({"fp8_enabled": True, "fp8_layers": [2, 2]}, "twice"),
        ({"fp8_enabled": True, "fp4_enabled": True, "fp8_layers": [1, 2], "fp4_layers": [2, 3]}, r"\[2\] are in both"),
        ({"fp8_enabled": True, "fp4_enabled": True}, "list fp8_layers or fp4_layers"),
        ({"fp8_layers": [1]}, r"fp8_config\.enabled is false"),
        ({"fp8_enabled": True, "fp4_layers": [1]}, r"fp4_config\.enabled is false"),
        ({"fp8_enabled": True, "fp8_layers": ["1"]}, "integer layer numbers"),
    ],
)
def test_bad_layer_lists_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_layer_precision(4, **kwargs)


def _config(enabled=False, layers=None, kind="fp8", recipe=None, fmt=None, kwargs=None):
    default_recipe, default_format = ("Float8BlockScaling", "E4M3") if kind == "fp8" else ("NVFP4BlockScaling", "E2M1")
    return {
        "enabled": enabled,
        f"{kind}_recipe": recipe or default_recipe,
        f"{kind}_format": fmt or default_format,
        f"{kind}_recipe_kwargs": kwargs or {},
        f"{kind}_layers": layers,
    }


def test_disabled_plan_never_imports_transformer_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # any import of it would now raise
    plan = build_quantization(_config(), _config(kind="fp4"), num_layers=3)
    assert plan.layer_precision is None and not plan.enabled
    assert plan.fp8_recipe is None and plan.fp4_recipe is None


def test_enabled_without_transformer_engine_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ImportError, match="TransformerEngine is not installed"):
        build_quantization(_config(enabled=True), _config(kind="fp4"), num_layers=3)


@pytest.fixture
def fake_te(monkeypatch):
    """A stand-in for transformer_engine.common.recipe with the fields the real recipes have."""
    Format = enum.Enum("Format", ["E2M1", "E4M3", "E5M2", "HYBRID"])

    @dataclasses.dataclass
    class DelayedScaling:
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024

    @dataclasses.dataclass
    class Float8BlockScaling:
        fp8_format: Format = Format.E4M3

    @dataclasses.dataclass
    class NVFP4BlockScaling:
        fp4_format: Format = Format.E2M1
        fp8_format: Format = Format.E4M3

    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    recipe.Float8BlockScaling, recipe.NVFP4BlockScaling = Float8BlockScaling, NVFP4BlockScaling
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.common = common
    monkeypatch.setitem(sys.modules, "transformer_engine", root)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    return recipe


def test_recipes_are_built_from_config(fake_te):
    fp8 = _config(enabled=True, layers=[1], recipe="DelayedScaling", fmt="HYBRID", kwargs={"amax_history_len": 16})
    plan = build_quantization(fp8, _config(enabled=True, kind="fp4"), num_layers=2)
    assert plan.layer_precision == ["fp8", "fp4"]
    assert plan.fp8_recipe == fake_te.DelayedScaling(fp8_format=fake_te.Format.HYBRID, amax_history_len=16)
    assert plan.fp4_recipe == fake_te.NVFP4BlockScaling(fp4_format=fake_te.Format.E2M1)


def test_recipe_only_built_when_a_layer_uses_it(fake_te):
    plan = build_quantization(_config(enabled=True), _config(kind="fp4"), num_layers=2)
    assert plan.fp8_recipe == fake_te.Float8BlockScaling() and plan.fp4_recipe is None


@pytest.mark.parametrize(
    ("fp8", "message"),
    [
        (_config(enabled=True, recipe="NVFP4BlockScaling"), "unknown recipe 'NVFP4BlockScaling'"),
        (_config(enabled=True, recipe="Float9"), "unknown recipe 'Float9'"),
        (_config(enabled=True, fmt="E9M9"), "unknown fp8_format 'E9M9'"),
        (_config(enabled=True, kwargs={"amax_history": 3}), r"has no option\(s\) \['amax_history'\]"),
    ],
)
def test_bad_recipe_settings_fail_clearly(fake_te, fp8, message):
    with pytest.raises(ValueError, match=message):
        build_quantization(fp8, _config(kind="fp4"), num_layers=2)
