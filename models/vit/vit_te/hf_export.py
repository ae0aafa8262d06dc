# Copied from common/hf_export.py — edit the source, then run ci/check_copies.py --fix
"""The one way a model leaves this project: a Hugging Face directory that loads anywhere with ``trust_remote_code``.

Both the model packages' converters (``<package>/export.py``) and the recipes' final export
(``checkpoint.export_final_model``) write through :func:`write_hf_directory`, so an export looks the same whichever
path made it:

- ``config.json`` with ``auto_map`` (the modeling file's ``AUTO_MAP``), ``architectures``, ``backend: auto`` (TE on a
  CUDA machine that has it, pure PyTorch elsewhere) and ``layer_precision: null`` (no FP8/FP4 layers: a training
  run's precision plan is not the loader's business, and the torch backend refuses it), ``recompute_layers: 0`` where
  the model has activation recompute;
- ``model.safetensors`` without TE's ``_extra_state`` (FP8 bookkeeping is runtime state, not weights), with a tied
  weight written once even when it was gathered from several ranks as two equal tensors;
- the modeling file that defines the model's class and the support files it imports from beside it;
- optionally the tokenizer, a model card (``README.md``) and a ``LICENSE``.

The directory is written beside its final name and renamed only once complete; an earlier export of the same name is
moved aside first and deleted only after the new one is in place, so an interrupted export never leaves a half-written
directory behind or destroys the last good one.
"""

import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


logger = logging.getLogger(__name__)

# Files a modeling file imports from beside it; an export ships those of them that sit beside it (the torch
# backend's three files and layer_autocast.py to all; te_attention.py and te_attention_backward.py to the models
# whose TE attention takes packed QKV, activation_recompute.py and layer_stack.py to all but ViT, packed_rope.py,
# fused_residual_layer.py, fp8_mlp.py and residual_norm.py to ESM-2, AMPLIFY and Llama, llama_decoding.py to Llama,
# encodon_layer.py to CodonFM).
MODELING_SUPPORT_FILES = (
    "torch_layers.py",
    "torch_attention.py",
    "torch_norm_linear.py",
    "packing.py",
    "meta_init.py",
    "te_attention.py",
    "te_attention_backward.py",
    "activation_recompute.py",
    "packed_rope.py",
    "fused_residual_layer.py",
    "fp8_mlp.py",
    "residual_norm.py",
    "layer_autocast.py",
    "layer_stack.py",
    "llama_decoding.py",
    "encodon_layer.py",
)


def tied_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """``{second name: first name}`` for every parameter reachable under two names (tied embeddings)."""
    first_name: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return aliases


def modeling_files(model: torch.nn.Module) -> tuple[list[Path], dict[str, str], str]:
    """The files an export ships, the ``AUTO_MAP`` and the architecture name of ``model``.

    The modeling file is the module that defines the model's class and an ``AUTO_MAP``. FSDP2 swaps in a subclass of
    its own, so look through the class hierarchy. Every module the ``AUTO_MAP`` names ships (the modeling file and the
    configuration file, ``configuration_<x>_te.py``), with the support files beside them.
    """
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and hasattr(module, "AUTO_MAP"):
            path = Path(module.__file__)
            named = dict.fromkeys(path.with_name(target.split(".")[0] + ".py") for target in module.AUTO_MAP.values())
            missing = [str(file) for file in named if not file.is_file()]
            if missing:
                raise FileNotFoundError(f"{path.name}'s AUTO_MAP names modules that are not beside it: {missing}")
            support = [path.with_name(name) for name in MODELING_SUPPORT_FILES if path.with_name(name).is_file()]
            return [path, *(file for file in named if file != path), *support], dict(module.AUTO_MAP), cls.__name__
    raise TypeError(
        f"{type(model).__name__} is not defined in a modeling file with an AUTO_MAP: it cannot be exported"
    )


def write_hf_directory(
    model: torch.nn.Module,
    output_dir: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    tokenizer: Any = None,
    model_card: str | None = None,
    license_file: str | Path | None = None,
) -> Path:
    """Write ``model`` as a loadable Hugging Face directory at ``output_dir`` (see the module docstring).

    Args:
        model: the model (possibly FSDP2-sharded): its config, class and ``save_pretrained`` are used.
        state_dict: full, unsharded weights to write instead of ``model.state_dict()`` (gathered from shards).
        tokenizer: anything with ``save_pretrained`` (a Hugging Face tokenizer), or None.
        model_card: the text of ``README.md``, or None for none.
        license_file: a file copied in as ``LICENSE``, or None.
    """
    output_dir = Path(output_dir)
    files, auto_map, architecture = modeling_files(model)
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"cannot export: the modeling files {missing} are missing beside the modeling file")
    source = state_dict if state_dict is not None else model.state_dict()
    weights = {k: v for k, v in source.items() if not k.endswith("_extra_state")}
    # A tied weight gathered from several ranks arrives as two equal copies; make them one tensor again so that
    # save_pretrained writes it once, as it does for a model that was never sharded.
    for alias, owner in tied_parameter_names(model).items():
        if alias in weights and owner in weights:
            weights[alias] = weights[owner]

    exported = {"auto_map": auto_map, "architectures": [architecture], "layer_precision": None, "backend": "auto"}
    if hasattr(model.config, "recompute_layers"):
        exported["recompute_layers"] = 0  # a memory setting of the training run, like its precision plan
    saved = {key: getattr(model.config, key, None) for key in exported}
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    previous = output_dir.with_name(f".{output_dir.name}.previous")
    if previous.exists() and not output_dir.exists():
        previous.rename(output_dir)  # an export died between its two renames: this is the last good one
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        for key, value in exported.items():
            setattr(model.config, key, value)
        model.save_pretrained(staging, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for path in files:
            shutil.copy2(path, staging / path.name)
        if model_card is not None:
            (staging / "README.md").write_text(model_card)
        if license_file is not None and Path(license_file).is_file():
            shutil.copy2(license_file, staging / "LICENSE")
        shutil.rmtree(previous, ignore_errors=True)
        if output_dir.exists():
            output_dir.rename(previous)
        staging.rename(output_dir)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for key, value in saved.items():
            setattr(model.config, key, value)
    logger.info("Exported %s to %s", architecture, output_dir)
    return output_dir
