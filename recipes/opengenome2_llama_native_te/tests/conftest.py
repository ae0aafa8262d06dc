"""Fixtures shared by the recipe's tests: the tokenizer, and one short L0 training run several test files inspect."""

from pathlib import Path

import pytest
from launch import RECIPE_DIR
from training import train
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer")


@pytest.fixture(scope="session")
def l0_run(tmp_path_factory) -> Path:
    """One process, 60 steps of L0_sanity (validation at steps 30 and 60, a checkpoint at 30 and 60, an export)."""
    output_dir = tmp_path_factory.mktemp("l0_run")
    train(output_dir, "num_train_steps=60", "validation.every_n_steps=30", "checkpoint.save_every=30")
    return output_dir
