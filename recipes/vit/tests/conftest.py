"""Fixtures: tiny image files and class-folder trees written into ``tmp_path`` per test, the L0 set of pattern
images, and a tiny stock Hugging Face ViT checkpoint.

Images are solid colours unless asked to be textured: the red channel of image k is ``code_color(k)[0] == k``, so
the pixels of a batch tell which images it holds, whatever crop or flip they went through.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import ViTConfig, ViTForImageClassification


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_sample_images import make_sample_images


def code_color(code: int) -> tuple[int, int, int]:
    """The colour of image number ``code`` (0..255): red is the code itself."""
    return (code, 255 - code, 128)


@pytest.fixture
def write_image(tmp_path):
    """``write_image(relative, color=(0, 0, 0), mode="RGB", size=(12, 10), texture_seed=None) -> Path``: an image
    file under ``tmp_path``, its format from the extension; ``texture_seed`` draws random pixels instead of a colour."""

    def write(relative, color=(0, 0, 0), mode="RGB", size=(12, 10), texture_seed=None) -> Path:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if texture_seed is None:
            image = Image.new("RGB", size, color)
        else:
            pixels = np.random.default_rng(texture_seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            image = Image.fromarray(pixels)
        (image if mode == "RGB" else image.convert(mode)).save(path)
        return path

    return write


@pytest.fixture
def image_tree(write_image, tmp_path):
    """``image_tree({"cat": 3, "ant": 2}, root="data", textured=False) -> Path``: class folders under
    ``tmp_path/root``; the k-th image written (classes in the order given) is ``<class>/<k:03d>.png`` of colour
    ``code_color(k)`` (or random pixels seeded with k)."""

    def make(classes: dict[str, int], root: str = "data", textured: bool = False) -> Path:
        code = 0
        for name, count in classes.items():
            for _ in range(count):
                write_image(f"{root}/{name}/{code:03d}.png", code_color(code), texture_seed=code if textured else None)
                code += 1
        (tmp_path / root).mkdir(parents=True, exist_ok=True)
        return tmp_path / root

    return make


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """The L0 set: 4 classes x 250 images (the val split takes 10%: 100 images)."""
    root = tmp_path_factory.mktemp("data") / "sample_images"
    make_sample_images(root)
    return root


def stock_vit(num_labels: int, path: Path) -> ViTForImageClassification:
    """A tiny stock ``ViTForImageClassification`` of the L0 shape (32 pixels, patches of 4), random weights with a
    non-zero classifier bias, saved with ``save_pretrained`` at ``path``."""
    config = ViTConfig(
        image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )  # fmt: skip
    torch.manual_seed(3)
    model = ViTForImageClassification(config)
    with torch.no_grad():
        model.classifier.bias.normal_()  # zero at init: make it something a wrong load could not reproduce
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    """(directory, model): a tiny stock ViT for the L0 set's 4 classes."""
    path = tmp_path_factory.mktemp("stock") / "vit_tiny"
    return path, stock_vit(4, path)
