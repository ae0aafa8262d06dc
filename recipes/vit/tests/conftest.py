"""Fixtures of the data tests: tiny image files and class-folder trees written into ``tmp_path`` per test.

Images are solid colours unless asked to be textured: the red channel of image k is ``code_color(k)[0] == k``, so
the pixels of a batch tell which images it holds, whatever crop or flip they went through.
"""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image


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
