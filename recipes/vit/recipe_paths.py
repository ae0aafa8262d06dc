# Copied from common/recipe_paths.py — edit the source, then run ci/check_copies.py --fix
"""Where a recipe's files are, and which Hydra config is running.

Paths in the configs (``model_tag``, ``tokenizer_path``, ``dataset.path``) may be given from the working directory
or relative to the recipe folder, so that ``python train_fsdp2.py`` works from anywhere. A model or tokenizer
directory that is missing, or lacks a file, fails here in one line (:func:`model_directory`,
:func:`tokenizer_source`): Transformers would build a default-sized model from a directory without ``config.json``.
"""

import json
from pathlib import Path

import hydra
from user_errors import PathNotFoundError


RECIPE_DIR = Path(__file__).resolve().parent


def recipe_path(path: str) -> Path:
    """A path as given when it exists from the working directory, else relative to this recipe folder."""
    return Path(path) if Path(path).exists() or Path(path).is_absolute() else RECIPE_DIR / path


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def looks_like_hub_id(value: str) -> bool:
    """``org/name``, as a Hugging Face Hub id reads (a local path starts with ``/`` or ``.``, or has more parts)."""
    return not Path(value).is_absolute() and not value.startswith(".") and value.count("/") == 1


def model_directory(value: str, key: str = "model_tag", weights: bool = False, remote_code: bool = False) -> Path:
    """``value`` (the config key or argument ``key``) as a model directory holding ``config.json``.

    ``weights`` also asks for the weights file, ``remote_code`` for the modeling files that ``config.json``'s
    ``auto_map`` names (what ``trust_remote_code=True`` imports from an export).
    """
    path = recipe_path(value)
    if not path.is_dir():
        raise PathNotFoundError(f"{key}={value}: no such directory; point {key} at a model directory (config.json)")
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if weights and not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append("model.safetensors")
    if remote_code and not missing:
        auto_map = json.loads((path / "config.json").read_text()).get("auto_map") or {}
        references = [
            ref for ref in auto_map.values() if isinstance(ref, str)
        ]  # "module.Class" or "repo--module.Class"
        modules = {ref.split("--")[-1].rsplit(".", 1)[0] for ref in references}
        missing += sorted(f"{module}.py" for module in modules if not (path / f"{module}.py").is_file())
    if missing:
        raise PathNotFoundError(
            f"{key}={value} lacks {', '.join(missing)}: point {key} at a complete model directory (an export such "
            "as <output_dir>/final_model), or export it again"
        )
    return path


def tokenizer_source(value: str, key: str = "tokenizer_path") -> str:
    """``value`` as a tokenizer directory (recipe-relative paths included), or as a Hub id when it looks like one."""
    path = recipe_path(value)
    if not path.exists() and looks_like_hub_id(value):
        return value
    if not path.is_dir():
        raise PathNotFoundError(f"{key}={value}: no such directory; point {key} at a tokenizer directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise PathNotFoundError(
            f"{key}={value} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}): point {key} at a tokenizer "
            "directory, such as the recipe's tokenizer/ or an export"
        )
    return str(path)


def config_name() -> str:
    """The Hydra config this run started from (recorded in summary.json)."""
    return hydra.core.hydra_config.HydraConfig.get().job.config_name
