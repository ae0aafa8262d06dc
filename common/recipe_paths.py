"""Where a recipe's files are, and which Hydra config is running.

Paths in the configs (``model_tag``, ``tokenizer_path``, ``dataset.path``) may be given from the working directory
or relative to the recipe folder, so that ``python train_fsdp2.py`` works from anywhere.
"""

from pathlib import Path

import hydra


RECIPE_DIR = Path(__file__).resolve().parent


def recipe_path(path: str) -> Path:
    """A path as given when it exists from the working directory, else relative to this recipe folder."""
    return Path(path) if Path(path).exists() or Path(path).is_absolute() else RECIPE_DIR / path


def config_name() -> str:
    """The Hydra config this run started from (recorded in summary.json)."""
    return hydra.core.hydra_config.HydraConfig.get().job.config_name
