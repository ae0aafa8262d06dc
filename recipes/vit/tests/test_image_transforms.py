"""The pure-torch image transforms (image_transforms.py) against hand-computed values, their random draws against
the bounds they promise, and, where torchvision imports (the GPU machine), against torchvision itself."""

import importlib.util

import numpy as np
import pytest
import torch
from image_transforms import (
    CenterCrop,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToRGBTensor,
    build_transforms,
    resize,
    resized_crop,
    to_rgb,
)
from PIL import Image


def textured(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def gradient(height: int, width: int) -> torch.Tensor:
    """A [1, height, width] float image with value 10 * x + 40 * y at column x, row y."""
    y, x = torch.meshgrid(
        torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32), indexing="ij"
    )
    return (10 * x + 40 * y)[None]


# Halving 4 pixels to 2 with the antialiased bilinear (triangle) filter: output pixel 0 is centred on input 0.5 and
# covers +-2 input pixels, so it weighs inputs 0, 1, 2 by 0.75, 0.75, 0.25 (normalised by 1.75); pixel 1 weighs inputs
# 1, 2, 3 by 0.25, 0.75, 0.75. On a ramp 0, 1, 2, 3 that gives 1.25 / 1.75 = 5/7 and 4 / 1.75 = 16/7.
HALVED_RAMP = (5 / 7, 16 / 7)

# ------------------------------------------------------------------------------------------ shapes and values


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("size", [(30, 20), (20, 30), (16, 16), (7, 5)])
def test_pipelines_give_float32_square_images(train, size):
    transform = build_transforms(16, train=train, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    for image in (textured(*size), textured(*size).convert("L")):
        pixels = transform(image, torch.Generator().manual_seed(0))
        assert pixels.shape == (3, 16, 16) and pixels.dtype == torch.float32
        assert pixels.min() >= -1.0001 and pixels.max() <= 1.0001  # [0, 1] normalised by 0.5, 0.5


def test_downscaling_averages_with_the_triangle_filter():
    out = resize(gradient(4, 4), 2, 2)[0]
    a = torch.tensor(HALVED_RAMP)
    assert torch.allclose(out, 10 * a[None, :] + 40 * a[:, None], atol=1e-5)  # separable: each axis on its own


def test_upscaling_interpolates_between_pixel_centres():
    # align_corners=False: output centres at input -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1)
    out = resize(torch.tensor([[[0.0, 100.0]]]), 1, 4)
    assert torch.allclose(out, torch.tensor([[[0.0, 25.0, 75.0, 100.0]]]))


def test_resized_crop_resizes_the_box():
    out = resized_crop(gradient(6, 6), top=1, left=2, height=4, width=4, size=2)[0]
    a = torch.tensor(HALVED_RAMP)
    assert torch.allclose(out, 10 * (2 + a[None, :]) + 40 * (1 + a[:, None]), atol=1e-5)


def test_a_crop_of_the_output_size_is_the_slice_itself():
    image = ToRGBTensor()(textured(8, 8)).float()
    crop = RandomResizedCrop(4, scale=(0.25, 0.25), ratio=(1.0, 1.0))  # always a 4 x 4 box of the 8 x 8 image
    boxes = set()
    for seed in range(30):
        top, left, height, width = crop.get_params(8, 8, torch.Generator().manual_seed(seed))
        assert (height, width) == (4, 4)
        out = crop(image, torch.Generator().manual_seed(seed))
        assert torch.equal(out, image[:, top : top + 4, left : left + 4])
        boxes.add((top, left))
    assert len(boxes) > 10 and {t for t, _ in boxes} == {0, 1, 2, 3, 4}  # placed anywhere the box fits


def test_horizontal_flip_reverses_the_last_dimension():
    image = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]])
    assert RandomHorizontalFlip(p=1.0)(image, torch.Generator()).tolist() == [[[3, 2, 1], [6, 5, 4]]]
    assert RandomHorizontalFlip(p=0.0)(image, torch.Generator()).tolist() == image.tolist()
    flips = [RandomHorizontalFlip()(image, torch.Generator().manual_seed(s))[0, 0, 0].item() == 3 for s in range(400)]
    assert 0.4 < np.mean(flips) < 0.6


def test_normalize_matches_a_hand_computation():
    # 51 / 255 = 0.2 in every channel: (0.2 - 0.5) / 0.5, (0.2 - 0.4) / 0.2, (0.2 - 0.3) / 0.1
    transform = build_transforms(8, train=False, mean=(0.5, 0.4, 0.3), std=(0.5, 0.2, 0.1))
    pixels = transform(Image.new("RGB", (10, 12), (51, 51, 51)))
    for channel, expected in enumerate((-0.6, -1.0, -1.0)):
        assert torch.allclose(pixels[channel], torch.full((8, 8), expected), atol=1e-5)
    assert torch.allclose(Normalize((0.5,) * 3, (0.25,) * 3)(torch.ones(3, 1, 1)), torch.full((3, 1, 1), 2.0))
    with pytest.raises(ValueError, match="positive"):
        Normalize((0.5,) * 3, (0.5, 0.0, 0.5))


def test_eval_path_resizes_the_shorter_side_then_crops_the_centre():
    image = gradient(8, 12)  # 8 x 12: the shorter side 8 -> 4, the longer 12 -> 6, then the central 4 x 4
    resized = Resize(4)(image)
    assert resized.shape == (1, 4, 6)
    assert torch.allclose(CenterCrop(4)(resized), resized[:, :, 1:5])
    assert Resize(4)(gradient(12, 8)).shape == (1, 6, 4)
    # an odd margin: 7 - 4 = 3 leaves round(1.5) = 2 columns on the left, as torchvision does
    assert torch.equal(CenterCrop(4)(gradient(4, 7)), gradient(4, 7)[:, :, 2:6])
    padded = CenterCrop(4)(torch.ones(1, 2, 3))  # smaller than the crop: zeros around it, an odd one right
    assert padded.tolist() == [[[0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]]]
    assert build_transforms(224, train=False).steps[0].shorter_side == 256  # 224 / 0.875


# ------------------------------------------------------------------------------------------------- randomness


def test_the_same_seed_gives_the_same_augmentation():
    transform, image = build_transforms(16, train=True), textured(40, 30)
    first = transform(image, torch.Generator().manual_seed(7))
    assert torch.equal(first, transform(image, torch.Generator().manual_seed(7)))
    others = [transform(image, torch.Generator().manual_seed(seed)) for seed in range(8, 14)]
    assert not any(torch.equal(first, other) for other in others)


def test_random_resized_crop_boxes_respect_scale_and_ratio():
    height, width, scale, ratio = 120, 100, (0.08, 1.0), (3 / 4, 4 / 3)
    crop = RandomResizedCrop(16, scale, ratio)
    generator = torch.Generator().manual_seed(0)
    boxes = np.array([crop.get_params(height, width, generator) for _ in range(3000)])
    top, left, box_height, box_width = boxes.T
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + box_height <= height).all() and (left + box_width <= width).all()
    area = box_height * box_width / (height * width)
    aspect = box_width / box_height
    # rounding each side to whole pixels (>= 31 px here) moves area and aspect by at most ~3%
    assert area.min() >= scale[0] * 0.97 and area.max() <= 1.0
    assert aspect.min() >= ratio[0] * 0.97 and aspect.max() <= ratio[1] * 1.03
    assert area.min() < 0.1 and area.max() > 0.9  # the whole range is drawn
    assert abs(np.log(aspect).mean()) < 0.03  # log-uniform over a symmetric range: centred on 1
    assert 0.3 < (area < 0.5).mean() < 0.6  # uniform area: 46% below 0.5, fewer when big boxes fail to fit
    room = height - box_height
    assert abs((top[room > 0] / room[room > 0]).mean() - 0.5) < 0.05  # placed uniformly


def test_random_resized_crop_falls_back_to_a_central_box_within_the_ratio():
    # No box of >= 90% of a square has an aspect ratio of 3..4: the fallback takes the full width and the height
    # the smallest allowed ratio gives (30 / 3 = 10), centred.
    assert RandomResizedCrop(8, (0.9, 1.0), (3.0, 4.0)).get_params(30, 30, torch.Generator()) == (10, 0, 10, 30)
    # A 10 x 100 strip cannot hold half its area in a box of ratio <= 4/3: full height, width round(10 * 4/3) = 13.
    assert RandomResizedCrop(8, (0.5, 1.0)).get_params(10, 100, torch.Generator()) == (0, 43, 10, 13)


# ----------------------------------------------------------------------------------------------- image modes


def mode_image(mode: str) -> Image.Image:
    if mode == "I;16":
        return Image.new("I;16", (4, 3), 32896)  # 128 * 257: the middle of the 16-bit range
    if mode == "I":
        return Image.new("I", (4, 3), 65535)
    if mode == "P":
        image = Image.new("P", (4, 3), 1)
        image.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
        return image
    if mode == "P+transparency":
        image = mode_image("P")
        image.info["transparency"] = 1
        return image
    colors = {"1": 1, "L": 100, "LA": (100, 0), "RGBA": (10, 20, 30, 0), "CMYK": (0, 0, 0, 0), "YCbCr": (128, 128, 128),
              "RGB": (1, 2, 3)}  # fmt: skip
    return Image.new(mode, (4, 3), colors[mode])


@pytest.mark.parametrize(
    "mode, rgb",
    [
        ("RGB", (1, 2, 3)),
        ("1", (255, 255, 255)),
        ("L", (100, 100, 100)),
        ("LA", (100, 100, 100)),  # alpha 0 dropped, not composited on black
        ("RGBA", (10, 20, 30)),  # likewise
        ("P", (200, 100, 50)),  # palette entry 1
        ("P+transparency", (200, 100, 50)),
        ("CMYK", (255, 255, 255)),  # no ink: white
        ("YCbCr", (128, 128, 128)),
        ("I;16", (128, 128, 128)),  # 16-bit scaled to 8, not clipped at 255
        ("I", (255, 255, 255)),
    ],
)
def test_every_mode_becomes_three_channel_rgb(mode, rgb):
    pixels = ToRGBTensor()(mode_image(mode))
    assert pixels.shape == (3, 3, 4) and pixels.dtype == torch.uint8
    assert pixels[:, 0, 0].tolist() == list(rgb) and (pixels == pixels[:, :1, :1]).all()
    assert to_rgb(mode_image(mode)).mode == "RGB"


# ------------------------------------------------------------------------------------------------ torchvision


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None,
    reason="torchvision is not installed (its PyPI wheels need CUDA torch; it runs on the GPU machine)",
)
def test_matches_torchvision():
    import torchvision.transforms as transforms_v1  # here, not at the top: collection must not import it on CPU CI
    from torchvision.transforms import v2

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    image = textured(75, 50, seed=3)
    reference = v2.Compose(
        [
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Resize(round(32 / 0.875), antialias=True),
            v2.CenterCrop(32),
            v2.Normalize(mean, std),
        ]
    )
    ours = build_transforms(32, train=False, mean=mean, std=std)(image)
    assert torch.allclose(ours, reference(image), atol=1e-5)

    # The Pillow path (PIL resize, ToTensor) rounds to 8 bits in between: close, not equal.
    pil_reference = transforms_v1.Compose(
        [
            transforms_v1.Resize(37),
            transforms_v1.CenterCrop(32),
            transforms_v1.ToTensor(),
            transforms_v1.Normalize(mean, std),
        ]
    )
    difference = (ours - pil_reference(image)).abs()
    assert difference.mean() < 0.02 and difference.max() < 0.2

    # The same random draws give the same boxes, and the same box the same pixels.
    tensor = v2.ToDtype(torch.float32, scale=True)(v2.ToImage()(image))
    crop = RandomResizedCrop(32)
    for seed in range(300):
        torch.manual_seed(seed)  # torchvision draws from the default generator
        expected = transforms_v1.RandomResizedCrop.get_params(tensor, scale=[0.08, 1.0], ratio=[3 / 4, 4 / 3])
        assert crop.get_params(50, 75, torch.Generator().manual_seed(seed)) == tuple(expected)
    box = crop.get_params(50, 75, torch.Generator().manual_seed(0))
    theirs = v2.functional.resized_crop(tensor, *box, size=[32, 32], antialias=True)
    assert torch.allclose(resized_crop(tensor, *box, size=32), theirs, atol=1e-5)
