"""Low-precision training settings: which TransformerEngine recipe, and which layers run in FP8 or FP4.

The config groups (see ``hydra_config/defaults.yaml``)::

    fp8_config: {enabled, fp8_recipe, fp8_format, fp8_recipe_kwargs, fp8_layers, keep_first_last_bf16}
    fp4_config: {enabled, fp4_recipe, fp4_format, fp4_recipe_kwargs, fp4_layers}

become a :class:`QuantizationPlan`: one ``layer_precision`` entry per transformer layer (``"fp8"``, ``"fp4"`` or
None for bf16) that goes into the model config, plus the recipe objects the model applies per layer.

Layer lists are 1-indexed, as people count layers. ``fp8_config.keep_first_last_bf16: N`` is the other way to
choose FP8 layers: layers ``N+1 .. L-N`` in FP8, the first and last N in bf16. With only one format enabled, an empty list means "every
layer". With both enabled, the one left empty claims every layer the other does not list. TransformerEngine is
imported only when a format is enabled, so this module works on machines without it.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from user_errors import ConfigError, MissingPackageError, UnsupportedHardwareError


FP8_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
FP4_RECIPES = ("NVFP4BlockScaling",)
# TransformerEngine's own test of whether this GPU (and CUDA) runs a recipe.
SUPPORT_CHECKS = {
    "DelayedScaling": "is_fp8_available",
    "Float8CurrentScaling": "is_fp8_available",
    "Float8BlockScaling": "is_fp8_block_scaling_available",
    "MXFP8BlockScaling": "is_mxfp8_available",
    "NVFP4BlockScaling": "is_nvfp4_available",
}


@dataclass
class QuantizationPlan:
    layer_precision: list[str | None] | None  # None when every layer runs in bf16
    fp8_recipe: Any = None
    fp4_recipe: Any = None

    @property
    def enabled(self) -> bool:
        return self.layer_precision is not None


def _check_layers(name: str, layers: Sequence[int], num_layers: int) -> set[int]:
    layers = list(layers)
    if any(not isinstance(layer, int) or isinstance(layer, bool) for layer in layers):
        raise ConfigError(f"{name} must be a list of integer layer numbers, got {layers}")
    out_of_range = sorted(layer for layer in layers if not 1 <= layer <= num_layers)
    if out_of_range:
        raise ConfigError(f"{name} has layers {out_of_range} outside 1..{num_layers} (layers are 1-indexed)")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{name} lists a layer twice: {layers}")
    return set(layers)


def resolve_layer_precision(
    num_layers: int,
    fp8_enabled: bool = False,
    fp8_layers: Sequence[int] | None = None,
    fp4_enabled: bool = False,
    fp4_layers: Sequence[int] | None = None,
) -> list[str | None] | None:
    """Per-layer precision (index 0 = layer 1), or None when neither format is enabled.

    Raises ``ValueError`` for a list given while its format is disabled, layers out of range or repeated, a layer
    in both lists, and for both formats enabled with neither list given (which layers get which is then unclear).
    """
    for name, enabled, layers in (("fp8_layers", fp8_enabled, fp8_layers), ("fp4_layers", fp4_enabled, fp4_layers)):
        if layers and not enabled:
            config = name.split("_")[0] + "_config"
            raise ConfigError(f"{name} is set to {list(layers)} but {config}.enabled is false")
    if not fp8_enabled and not fp4_enabled:
        return None

    fp8 = _check_layers("fp8_layers", fp8_layers or [], num_layers)
    fp4 = _check_layers("fp4_layers", fp4_layers or [], num_layers)
    everything = set(range(1, num_layers + 1))
    if fp8_enabled and fp4_enabled:
        if not fp8 and not fp4:
            raise ConfigError("fp8 and fp4 are both enabled: list fp8_layers or fp4_layers (or both) to split layers")
        if fp8 & fp4:
            raise ConfigError(f"layers {sorted(fp8 & fp4)} are in both fp8_layers and fp4_layers")
        if not fp8:
            fp8 = everything - fp4
        elif not fp4:
            fp4 = everything - fp8
    elif fp8_enabled and not fp8:
        fp8 = everything
    elif fp4_enabled and not fp4:
        fp4 = everything
    return ["fp8" if layer in fp8 else "fp4" if layer in fp4 else None for layer in range(1, num_layers + 1)]


def _te_recipe_module():
    try:
        from transformer_engine.common import recipe
    except ImportError as error:
        raise MissingPackageError(
            "fp8_config/fp4_config are enabled but TransformerEngine is not installed; install it (FP8 also needs a "
            "GPU with compute capability >= 8.9) or set fp8_config.enabled=false fp4_config.enabled=false"
        ) from error
    return recipe


def build_recipe(name: str, fmt: str | None, kwargs: Mapping[str, Any] | None, allowed: Sequence[str]) -> Any:
    """Instantiate ``transformer_engine.common.recipe.<name>`` with the given format and extra keyword arguments."""
    if name not in allowed:
        raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join(allowed)}")
    recipe_module = _te_recipe_module()
    recipe_class = getattr(recipe_module, name)
    field_names = {field.name for field in dataclasses.fields(recipe_class)}
    arguments = dict(kwargs or {})
    unknown = sorted(set(arguments) - field_names)
    if unknown:
        raise ConfigError(f"{name} has no option(s) {unknown}; it takes {sorted(field_names)}")
    if fmt is not None:
        # FP8 recipes call it fp8_format; NVFP4 calls its element format fp4_format (and keeps fp8_format for scales).
        format_field = "fp4_format" if name in FP4_RECIPES else "fp8_format"
        try:
            arguments[format_field] = recipe_module.Format[fmt]
        except KeyError:
            choices = ", ".join(member.name for member in recipe_module.Format)
            raise ConfigError(f"unknown {format_field} {fmt!r}; choose one of {choices}") from None
    return recipe_class(**arguments)


def fp8_layers_keeping_first_last_bf16(num_layers: int, keep: int) -> list[int]:
    """The 1-indexed FP8 layers when the first ``keep`` and the last ``keep`` layers stay in bf16.

    The first layers see raw embeddings and the last ones feed the output head: their activations have the widest
    dynamic range, where FP8's 3-bit mantissa costs the most accuracy (a common stabiliser for FP8 pre-training).
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"fp8_config.keep_first_last_bf16 must be an integer >= 0, got {keep!r}")
    if 2 * keep >= num_layers:
        raise ConfigError(f"fp8_config.keep_first_last_bf16={keep} leaves no FP8 layer in a {num_layers}-layer model")
    return list(range(keep + 1, num_layers - keep + 1))


def _fp8_layers(fp8_config: Mapping[str, Any], num_layers: int) -> Sequence[int] | None:
    """``fp8_layers`` as given, or the list that ``keep_first_last_bf16`` stands for."""
    keep = fp8_config.get("keep_first_last_bf16") or 0
    if not keep:
        return fp8_config.get("fp8_layers")
    if not fp8_config["enabled"]:
        raise ConfigError("fp8_config.keep_first_last_bf16 is set but fp8_config.enabled is false")
    if fp8_config.get("fp8_layers"):
        raise ConfigError("set either fp8_config.fp8_layers or fp8_config.keep_first_last_bf16, not both")
    return fp8_layers_keeping_first_last_bf16(num_layers, keep)


def check_quantized_gemm_shapes(dims: Mapping[str, int], note: str = "") -> None:
    """FP8/FP4 GEMMs need every width they multiply along (hidden size, FFN width) to be a multiple of 16; TE
    otherwise asserts it on the first forward, deep in a traceback. ``dims``: name -> width; ``note`` follows the
    widths in the message (how a width was derived)."""
    bad = [f"{name} {value}" for name, value in dims.items() if value % 16]
    if bad:
        raise ConfigError(
            f"FP8/FP4 layers need {' and '.join(dims)} to be multiples of 16, got {', '.join(bad)}{note}: change "
            "model_config_overrides or turn fp8/fp4 off"
        )


def build_quantization(fp8_config: Mapping[str, Any], fp4_config: Mapping[str, Any], num_layers: int):
    """The :class:`QuantizationPlan` for a model with ``num_layers`` transformer layers."""
    fp8_enabled, fp4_enabled = bool(fp8_config["enabled"]), bool(fp4_config["enabled"])
    layer_precision = resolve_layer_precision(
        num_layers, fp8_enabled, _fp8_layers(fp8_config, num_layers), fp4_enabled, fp4_config.get("fp4_layers")
    )
    if layer_precision is None:
        return QuantizationPlan(layer_precision=None)
    fp8_recipe = fp4_recipe = None
    if "fp8" in layer_precision:
        fp8_recipe = build_recipe(
            fp8_config["fp8_recipe"], fp8_config.get("fp8_format"), fp8_config.get("fp8_recipe_kwargs"), FP8_RECIPES
        )
    if "fp4" in layer_precision:
        fp4_recipe = build_recipe(
            fp4_config["fp4_recipe"], fp4_config.get("fp4_format"), fp4_config.get("fp4_recipe_kwargs"), FP4_RECIPES
        )
    return QuantizationPlan(layer_precision, fp8_recipe, fp4_recipe)


def check_quantization_supported(plan: QuantizationPlan, device: Any) -> None:
    """Fail at start-up, in one line, when this machine cannot run the plan's FP8/FP4 layers.

    Without the check the model would fall back to the torch backend ("fp8 layers need the TransformerEngine
    backend") or TE would stop at the first forward pass of a GPU without FP8 tensor cores.
    """
    recipes = [recipe for recipe in (plan.fp8_recipe, plan.fp4_recipe) if recipe is not None]
    if not recipes:
        return
    names = " and ".join(type(recipe).__name__ for recipe in recipes)
    if getattr(device, "type", str(device)) != "cuda":
        raise UnsupportedHardwareError(
            f"{names} needs a CUDA GPU with TransformerEngine, but this run is on the {device}: set "
            "fp8_config.enabled=false and fp4_config.enabled=false to train in bf16/fp32 here"
        )
    import transformer_engine.pytorch as te

    for recipe in recipes:
        name = type(recipe).__name__
        supported, reason = _te_supports(te, name)
        if not supported:
            others = ", ".join(other for other in FP8_RECIPES if other != name)
            raise UnsupportedHardwareError(
                f"{name} cannot run on this GPU ({reason}): choose another fp8_config.fp8_recipe ({others}) or set "
                "fp8_config.enabled=false / fp4_config.enabled=false"
            )


def _te_supports(te: Any, recipe_name: str) -> tuple[bool, str]:
    """TE's verdict on this GPU for a recipe; (True, "") where this TE release cannot say (then TE decides later)."""
    check = getattr(te, SUPPORT_CHECKS.get(recipe_name, ""), None)
    if check is None:
        return True, ""
    try:
        verdict = check(return_reason=True)
    except TypeError:  # a release without return_reason
        verdict = check()
    return (bool(verdict[0]), str(verdict[1])) if isinstance(verdict, tuple) else (bool(verdict), "")
