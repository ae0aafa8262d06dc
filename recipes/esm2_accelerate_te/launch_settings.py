"""What ``accelerate launch --config_file accelerate_config/<file>.yaml`` asked for, read once at start-up.

``accelerate launch`` hands its config to the training process as environment variables (``ACCELERATE_*``,
``FSDP_*``). The Trainer reads them again when it builds its ``Accelerator``; this module reads them first, to
check the request against the model and the machine (one clear line instead of a traceback deep in a step), and to
take over FP8:

accelerate's own FP8 path for TransformerEngine converts every ``nn.Linear`` and ``nn.LayerNorm`` it finds into TE
modules and runs the whole forward under one ``fp8_autocast``. On this recipe's model (already TE) that would convert
the LM head too: its decoder is tied to the input embeddings, and the converted copy is no longer tied. And
``TrainingArguments(bf16=True)`` would silently replace ``mixed_precision: fp8`` with bf16. So with
``mixed_precision: fp8`` this recipe builds the TE recipe from accelerate's ``fp8_config`` (accelerate's own
``TERecipeKwargs`` parses it), gives it to the model's transformer layers (the model's per-layer FP8 support, as
in recipes/esm2_native_te), and launches the Trainer in bf16 with accelerate's FP8 switched off, so that nothing
converts or wraps the model a second time.
"""

import logging
import os
from dataclasses import dataclass

from user_errors import ConfigError, UnsupportedHardwareError


logger = logging.getLogger(__name__)

PRECISIONS = ("no", "bf16", "fp8")


@dataclass(frozen=True)
class LaunchSettings:
    precision: str  # "no" (float32), "bf16" or "fp8"
    fsdp: bool  # FSDP2 (distributed_type: FSDP)
    fsdp_layer_class: str | None  # fsdp_transformer_layer_cls_to_wrap
    use_cpu: bool
    launched: bool  # started by accelerate launch (False: plain python)

    @classmethod
    def from_environment(cls) -> "LaunchSettings":
        env = os.environ
        precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
        if precision not in PRECISIONS:
            raise ConfigError(f"mixed_precision: {precision} in the accelerate config; this recipe runs {PRECISIONS}")
        fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if fsdp and env.get("FSDP_VERSION", "1") != "2":
            raise ConfigError("the accelerate config asks for FSDP1; this recipe uses FSDP2: set fsdp_version: 2")
        return cls(
            precision=precision,
            fsdp=fsdp,
            fsdp_layer_class=env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None,
            use_cpu=env.get("ACCELERATE_USE_CPU", "false").lower() == "true",
            launched="ACCELERATE_MIXED_PRECISION" in env,
        )

    def describe(self) -> str:
        strategy = "FSDP2" if self.fsdp else "DDP"
        return f"{strategy}, {'float32' if self.precision == 'no' else self.precision}"


def gpu_capability() -> tuple[int, int] | None:
    """The CUDA compute capability of this process's GPU (``LOCAL_RANK``; read before the Trainer sets the device),
    or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def check_launch(launch: LaunchSettings, cfg, capability: tuple[int, int] | None) -> None:
    """Refuse what the model or the machine (``capability``: see :func:`gpu_capability`) cannot do, before anything
    is built."""
    cuda_available = capability is not None
    if not launch.launched:
        logger.warning(
            "Not started by `accelerate launch`: one process, float32. For bf16, FP8 or FSDP2 run "
            "`accelerate launch --config_file accelerate_config/<default|fsdp2_te|fp8>.yaml train.py ...`"
        )
    if launch.fsdp and (launch.use_cpu or not cuda_available):
        raise UnsupportedHardwareError(
            "the accelerate config asks for FSDP, which needs GPUs here; on CPU use accelerate_config/cpu.yaml (DDP)"
        )
    if launch.precision == "fp8":
        if cfg.model_implementation == "hf":
            raise ConfigError("FP8 needs this recipe's TE model: model_implementation=nv (hf is the bf16 baseline)")
        if not cuda_available or launch.use_cpu:
            raise UnsupportedHardwareError("mixed_precision: fp8 needs an NVIDIA GPU (Hopper or newer); use cpu.yaml")
        mxfp8 = os.environ.get("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING", "false").lower() in ("1", "true", "yes")
        needed, generation = ((10, 0), "Blackwell") if mxfp8 else ((8, 9), "Ada/Hopper")
        if tuple(capability) < needed:
            raise UnsupportedHardwareError(
                f"{'MXFP8' if mxfp8 else 'FP8'} needs a {generation} GPU or newer (compute capability "
                f"{needed[0]}.{needed[1]}); this one is {capability[0]}.{capability[1]}: use default.yaml (bf16)"
            )
        backend = os.environ.get("ACCELERATE_FP8_BACKEND", "TE").upper()
        if backend != "TE":
            raise ConfigError(f"fp8_config.backend: {backend} in the accelerate config; this recipe's FP8 is TE's")
    elif cfg.fp8_layers or cfg.keep_first_last_bf16:
        raise ConfigError(
            "fp8_layers / keep_first_last_bf16 are set but the accelerate config does not ask for FP8: "
            "use --config_file accelerate_config/fp8.yaml (or fp8_fsdp2.yaml)"
        )
    if launch.fsdp and launch.fsdp_layer_class:
        expected = "EsmLayer" if cfg.model_implementation == "hf" else "TransformerLayer"
        if launch.fsdp_layer_class != expected:
            other = "fsdp2_te.yaml" if expected == "TransformerLayer" else "fsdp2_hf.yaml"
            raise ConfigError(
                f"the accelerate config wraps {launch.fsdp_layer_class} layers, but model_implementation="
                f"{cfg.model_implementation} has {expected} layers: use accelerate_config/{other}"
            )


def fp8_config_from_accelerate(launch: LaunchSettings, cfg) -> dict:
    """The ``quantization.build_quantization`` fp8 mapping for this launch: disabled unless mixed_precision is fp8,
    else accelerate's TE recipe settings on the layers ``fp8_layers`` / ``keep_first_last_bf16`` choose."""
    if launch.precision != "fp8":
        return {"enabled": False, "fp8_layers": None, "keep_first_last_bf16": 0}
    from accelerate.utils import TERecipeKwargs

    settings = TERecipeKwargs()  # accelerate's parsing of fp8_config (ACCELERATE_FP8_*), its defaults included
    if settings.use_mxfp8_block_scaling:
        recipe, kwargs = "MXFP8BlockScaling", {}
    else:
        recipe = "DelayedScaling"
        kwargs = {
            "margin": settings.margin,
            "amax_history_len": settings.amax_history_len,
            "amax_compute_algo": settings.amax_compute_algo,
        }
    if any(settings.override_linear_precision):
        raise ConfigError("fp8_config.override_linear_precision is not supported: TransformerEngine 2 removed it")
    return {
        "enabled": True,
        "fp8_recipe": recipe,
        "fp8_format": settings.fp8_format,
        "fp8_recipe_kwargs": kwargs,
        "fp8_layers": list(cfg.fp8_layers) if cfg.fp8_layers else None,
        "keep_first_last_bf16": int(cfg.keep_first_last_bf16),
    }


def hand_fp8_to_the_model() -> None:
    """From here on the model applies FP8 itself: the Trainer's Accelerator must see bf16 and no FP8 backend, or it
    would convert and wrap the model as well (see the module docstring)."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    os.environ.pop("ACCELERATE_FP8_BACKEND", None)
