"""Image transforms for ViT training and evaluation, in plain PyTorch (+ Pillow to decode).

torchvision is not used: its PyPI wheels are built against CUDA torch and do not import next to the CPU torch wheel
that CI installs. The transforms follow torchvision's definitions, so a model trained here sees what a torchvision
pipeline would show it (tests/test_image_transforms.py compares the two where torchvision imports).

``build_transforms(image_size, train, mean, std)`` returns the callable a dataset applies to each image,
``(pil_image, generator) -> float32 [3, image_size, image_size]``:

    train: decode to RGB -> [0, 1] -> RandomResizedCrop(image_size) -> RandomHorizontalFlip -> Normalize
    eval:  decode to RGB -> [0, 1] -> Resize(round(image_size / 0.875)) -> CenterCrop(image_size) -> Normalize

(the usual ImageNet recipe: Inception-style crops for training; for evaluation the shorter side to 256 and the
central 224 x 224). The random transforms draw only from the ``torch.Generator`` they are given, so an image's
augmentation is a pure function of that generator's seed (dataset.py seeds it per sample and epoch) and does not
depend on the worker process or on how many images came before.

Resizing is ``torch.nn.functional.interpolate(mode="bilinear", antialias=True, align_corners=False)`` in float32,
torchvision's default for tensors; the antialiasing filter makes downscaling average the covered pixels, as Pillow's
resize does, rather than sample a few of them.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


EVAL_CROP_FRACTION = 0.875  # 224 / 256: the central crop of the ImageNet evaluation protocol

# Modes whose alpha channel (or palette transparency) is dropped on the way to RGB; see ToRGBTensor.
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
INTEGER_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N")


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as an 8-bit RGB Pillow image, whatever its mode.

    Alpha is dropped, not composited: the colour stored under a transparent pixel is kept, as ``Image.convert``
    does and as torchvision's ImageFolder and Hugging Face's image processors see images, so a model fine-tuned
    here sees what the pre-trained one saw. 16/32-bit integer images (``I;16``, ``I``: 16-bit PNG and TIFF) are
    scaled from 0..65535 to 0..255; Pillow's own conversion would clip them at 255, turning most pixels white.
    """
    if image.mode == "RGB":
        return image
    if image.mode in INTEGER_MODES:
        values = np.asarray(image).astype(np.float64)
        gray = np.clip(np.round(values / 257.0), 0, 255).astype(np.uint8)  # 65535 / 255 = 257
        return Image.fromarray(np.repeat(gray[..., None], 3, axis=-1), mode="RGB")
    if image.mode in ("La", "RGBa"):  # premultiplied alpha: Pillow converts these to RGB only by way of RGBA
        image = image.convert("RGBA")
    elif image.mode in ("P", "PA") and "transparency" in image.info:
        image = image.convert("RGBA")  # Pillow warns when a palette with transparency goes straight to RGB
    return image.convert("RGB")


class ToRGBTensor:
    """Pillow image of any mode -> RGB ``uint8`` tensor ``[3, H, W]`` (see :func:`to_rgb` for the conversions)."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = np.array(to_rgb(image), dtype=np.uint8)  # a copy: torch warns on Pillow's read-only buffer
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


class ToFloat:
    """``uint8`` [0, 255] -> ``float32`` [0, 1]. Done before any resize, so interpolation never rounds to 8 bits."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.to(torch.float32) / 255.0


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``image`` [C, H, W] resized to [C, height, width]: bilinear, antialiased, float32 (same value scale)."""
    image = image.to(torch.float32)
    if tuple(image.shape[-2:]) == (height, width):
        return image
    resized = F.interpolate(image[None], size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return resized[0]


def resized_crop(image: torch.Tensor, top: int, left: int, height: int, width: int, size: int) -> torch.Tensor:
    """The box ``image[..., top:top + height, left:left + width]`` resized to ``size`` x ``size``."""
    return resize(image[..., top : top + height, left : left + width], size, size)


class RandomResizedCrop:
    """A random box of ``scale`` of the image's area and aspect ratio (width / height) in ``ratio``, resized to
    ``size`` x ``size`` (Inception-style crops, torchvision's ``RandomResizedCrop`` algorithm).

    Up to 10 attempts draw an area fraction uniformly in ``scale`` and an aspect ratio log-uniformly in ``ratio``;
    the first box that fits the image is placed uniformly at random. When none fits (a very wide or tall image),
    the largest central box whose aspect ratio is clamped into ``ratio`` is used. The draws are the same calls in
    the same order as torchvision's ``RandomResizedCrop.get_params``, so the same seed gives the same box.
    """

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        if not (0 < scale[0] <= scale[1] <= 1) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got {scale}, {ratio}")
        self.size, self.scale, self.ratio = int(size), (float(scale[0]), float(scale[1])), tuple(ratio)
        # float32 bounds, as torchvision computes them: the uniform draws then match it bit for bit.
        self.log_ratio = torch.log(torch.tensor(self.ratio, dtype=torch.float32))

    def get_params(self, height: int, width: int, generator: torch.Generator | None) -> tuple[int, int, int, int]:
        """The box ``(top, left, box_height, box_width)`` for an image of ``height`` x ``width``."""
        area = height * width
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(*self.scale, generator=generator).item()
            log_low, log_high = self.log_ratio.tolist()
            aspect = torch.exp(torch.empty(1).uniform_(log_low, log_high, generator=generator)).item()
            box_width = int(round(math.sqrt(target_area * aspect)))
            box_height = int(round(math.sqrt(target_area / aspect)))
            if 0 < box_width <= width and 0 < box_height <= height:
                top = int(torch.randint(0, height - box_height + 1, (1,), generator=generator).item())
                left = int(torch.randint(0, width - box_width + 1, (1,), generator=generator).item())
                return top, left, box_height, box_width
        aspect = width / height
        if aspect < min(self.ratio):  # too tall: full width, the tallest box the ratio allows
            box_width, box_height = width, int(round(width / min(self.ratio)))
        elif aspect > max(self.ratio):  # too wide: full height
            box_width, box_height = int(round(height * max(self.ratio))), height
        else:
            box_width, box_height = width, height
        return (height - box_height) // 2, (width - box_width) // 2, box_height, box_width

    def __call__(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        top, left, box_height, box_width = self.get_params(image.shape[-2], image.shape[-1], generator)
        return resized_crop(image, top, left, box_height, box_width, self.size)


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p`` (one draw from the generator per image, flipped or not)."""

    def __init__(self, p: float = 0.5):
        self.p = float(p)

    def __call__(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if torch.rand(1, generator=generator).item() < self.p:
            return image.flip(-1)
        return image


class Resize:
    """Resize so the shorter side is ``shorter_side`` pixels, keeping the aspect ratio (the longer side is
    truncated to an integer, as torchvision does)."""

    def __init__(self, shorter_side: int):
        self.shorter_side = int(shorter_side)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        if height <= width:
            return resize(image, self.shorter_side, int(self.shorter_side * width / height))
        return resize(image, int(self.shorter_side * height / width), self.shorter_side)


class CenterCrop:
    """The central ``size`` x ``size`` box (an odd margin leaves the extra pixel where torchvision does); an image
    smaller than that is first padded with zeros on both sides."""

    def __init__(self, size: int):
        self.size = int(size)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        if height < self.size or width < self.size:
            pad_h, pad_w = max(self.size - height, 0), max(self.size - width, 0)
            image = F.pad(image, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
            height, width = image.shape[-2:]
        top = int(round((height - self.size) / 2.0))
        left = int(round((width - self.size) / 2.0))
        return image[..., top : top + self.size, left : left + self.size]


class Normalize:
    """``(image - mean) / std`` per channel, on a float image in [0, 1]."""

    def __init__(self, mean, std):
        self.mean = torch.tensor([float(m) for m in mean], dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor([float(s) for s in std], dtype=torch.float32).view(-1, 1, 1)
        if self.mean.numel() != 3 or self.std.numel() != 3 or (self.std <= 0).any():
            raise ValueError(f"need 3 means and 3 positive standard deviations (RGB), got {mean} and {std}")

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


class ImageTransform:
    """A pipeline ``(pil_image, generator) -> float32 [3, S, S]``: decode to RGB, scale to [0, 1], then ``steps``
    (random steps take the generator), then normalize. A class, not a closure, so DataLoader workers can pickle it."""

    def __init__(self, steps: list, normalize: Normalize, random: bool):
        self.decode, self.to_float = ToRGBTensor(), ToFloat()
        self.steps, self.normalize, self.random = steps, normalize, random

    def __call__(self, image: Image.Image, generator: torch.Generator | None = None) -> torch.Tensor:
        pixels = self.to_float(self.decode(image))
        for step in self.steps:
            if isinstance(step, RandomResizedCrop | RandomHorizontalFlip):
                pixels = step(pixels, generator)
            else:
                pixels = step(pixels)
        return self.normalize(pixels).contiguous()


def build_transforms(image_size: int, train: bool, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> ImageTransform:
    """The training (random crop and flip) or evaluation (resize, central crop) pipeline; see the module docstring.

    ``mean`` and ``std`` are per RGB channel, for pixels in [0, 1]: (0.5, 0.5, 0.5) twice for Hugging Face's ViT
    checkpoints, (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225) for ImageNet-trained torchvision/timm models.
    """
    image_size = int(image_size)
    if train:
        steps = [RandomResizedCrop(image_size), RandomHorizontalFlip()]
    else:
        steps = [Resize(round(image_size / EVAL_CROP_FRACTION)), CenterCrop(image_size)]
    return ImageTransform(steps, Normalize(mean, std), random=train)
