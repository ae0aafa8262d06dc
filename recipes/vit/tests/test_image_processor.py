"""The export's image processor (``preprocessor_config.json``, model_setup.image_processor) against the reference it
must follow: the recipe's evaluation transform (image_transforms.build_transforms(train=False)), which validation
(choosing best_model) and infer.py use. A user who loads the export with ``AutoImageProcessor`` must give the model
the pixels validation gave it: the shorter side resized, then the central crop, not the whole image squashed square."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from image_transforms import build_transforms
from model_setup import image_processor
from omegaconf import OmegaConf
from PIL import Image
from transformers import ViTImageProcessorPil


# The Pillow processor resizes 8-bit pixels (rounded), the recipe float32 ones: about one grey level apart, so the
# comparison is in pixel values in [0, 1] (un-normalised) within 1.5 grey levels. (Measured: at most 1.0 / 255.)
TOLERANCE = 1.5 / 255
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def auto_image_processor(directory):
    """``AutoImageProcessor.from_pretrained(directory)``, offline. transformers 5.17 refuses its top-level
    ``AutoImageProcessor`` name where torchvision is missing (huggingface/transformers#48607) although the class needs
    only Pillow; the CPU CI has no torchvision, so there it is taken from its own module."""
    try:
        return transformers.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    except ImportError:
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(directory, local_files_only=True)


def photo(height: int, width: int, mode: str = "RGB") -> Image.Image:
    """A non-square image with detail everywhere: colour ramps along both axes, diagonal stripes and noise."""
    y, x = np.mgrid[0:height, 0:width]
    stripes = ((x + 2 * y) % 11) * 20.0
    pixels = np.stack([255.0 * x / width, 255.0 * y / height, stripes], axis=-1)
    pixels += np.random.default_rng(height * 1000 + width).normal(0.0, 12.0, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)


def exported_processor(tmp_path, side: int, mean, std):
    """The processor a run with ``dataset.mean/std`` exports for a model of ``side`` pixels, saved and loaded back."""
    cfg = OmegaConf.create({"dataset": {"mean": list(mean), "std": list(std)}})
    image_processor(cfg, SimpleNamespace(image_size=side)).save_pretrained(tmp_path)
    return auto_image_processor(tmp_path)


def pixels_in_01(normalised: torch.Tensor, mean, std) -> torch.Tensor:
    return normalised * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)


# (height, width): wider and taller than square, smaller and larger than the resize target. Each resized image's
# crop margin along its longer side (shorter side 37 for 32 pixels, 256 for 224) is 29, 16 or 202 pixels: not of the
# form 4k + 3, where Hugging Face's central crop sits one pixel off torchvision's (model_setup.image_processor).
@pytest.mark.parametrize(("side", "size"), [(32, (48, 80)), (32, (80, 48)), (32, (26, 20)), (224, (300, 500))])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_exported_processor_gives_the_pixels_of_the_evaluation_transform(tmp_path, side, size, mode):
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    processor = exported_processor(tmp_path, side, mean, std)
    image = photo(*size, mode=mode)
    reference = build_transforms(side, train=False, mean=mean, std=std)(image)
    exported = torch.from_numpy(np.asarray(processor(image, return_tensors="np")["pixel_values"][0]))
    assert exported.shape == reference.shape == (3, side, side)
    difference = (pixels_in_01(exported, mean, std) - pixels_in_01(reference, mean, std)).abs().max().item()
    assert difference <= TOLERANCE, f"{difference * 255:.2f} grey levels apart"

    # The test can tell: the former export (ViTImageProcessor: the whole image squashed to side x side; it did not
    # convert to RGB either, so a grayscale image failed outright) is far off.
    squashed = ViTImageProcessorPil(
        size={"height": side, "width": side}, image_mean=list(mean), image_std=list(std), do_convert_rgb=True
    )
    old = torch.from_numpy(np.asarray(squashed(image, return_tensors="np")["pixel_values"][0]))
    assert (pixels_in_01(old, mean, std) - pixels_in_01(reference, mean, std)).abs().max().item() > 0.1


def test_exported_processor_config_names_its_class_and_the_runs_normalisation(tmp_path):
    processor = exported_processor(tmp_path, 32, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    assert type(processor).__name__ in ("BitImageProcessor", "BitImageProcessorPil")  # torchvision's or Pillow's
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "BitImageProcessor"
    assert saved["size"] == {"shortest_edge": 37}  # round(32 / 0.875)
    assert saved["crop_size"] == {"height": 32, "width": 32} and saved["do_center_crop"] and saved["do_convert_rgb"]
    assert saved["resample"] == Image.Resampling.BILINEAR
    assert saved["image_mean"] == [0.5, 0.4, 0.3] and saved["image_std"] == [0.2, 0.25, 0.3]
