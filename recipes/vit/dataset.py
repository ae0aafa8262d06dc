"""Folders of labelled images -> training and validation batches for ViT image classification.

``create_dataloaders(data_cfg, image_size, dp_rank, dp_world_size, seed)`` is the entry point of the training
script. It returns ``(train_loader, val_loader, class_names)``:

- the train loader **yields forever** (it steps the epoch, reshuffling, on its own: the loop only calls ``next()``),
  each data-parallel rank drawing its own disjoint share of the images, and its ``state_dict()`` resumes exactly at
  the next batch. Augmentation (image_transforms.py) draws from a generator seeded with (seed, epoch, image index),
  so a resumed run sees the same crops and flips, bit for bit, whatever ``num_workers`` is;
- the val loader is finite and in order: rank r gets the validation images whose index is r modulo the world size,
  none padded or repeated, so correct-prediction counts summed over the ranks are exact. It is ``None`` when there is
  no validation split (``val_fraction: 0`` in layout a);
- ``class_names[i]`` is the name of class id ``i``.

A batch is ``{"pixel_values": float32 [B, 3, S, S], "labels": int64 [B]}`` (S = ``image_size``), what Hugging Face's
``ViTForImageClassification`` takes. The last batch of an epoch may be smaller than ``micro_batch_size``.

Layouts of ``dataset.path`` (a folder)::

    (a) class folders, torchvision's ImageFolder     root/<class>/<image>  (also deeper: root/<class>/a/b/<image>)
        Each class is split into train and val by val_fraction, deterministically given the seed (the same on every
        rank); every class keeps at least one training image.
    (b) Hugging Face imagefolder splits              root/train/<class>/<image> and root/validation/<class>/<image>
        The validation split is the first of validation/, val/, test/ present (val_fraction is then ignored; with
        train/ alone, val is split off it as in a). Other folders beside the splits are ignored, with a warning.
    (c) Hugging Face imagefolder metadata            root/metadata.csv or root/metadata.jsonl (or one per split
        folder of b: root/train/metadata.csv, ...), columns file_name (the image's path from the metadata file's
        folder) and label; other columns are ignored. With a root metadata file and split folders, a row belongs to
        the split its file_name starts with (train/..., validation/...). A metadata file wins over class folders.

Classes: folder names (a, b) or labels (c) that are names are sorted alphabetically and numbered 0..C-1, as
torchvision numbers ImageFolder classes. Labels that are all integers (JSON numbers, or digits in a CSV) are the class
ids themselves, and the names are "0".."C-1" (C = the largest training id + 1). A validation image whose class has no
training image is an error.

Scanning (image_folder.py; once per rank, when the loaders are built): files are images by extension (.png .jpg
.jpeg .bmp .gif .webp .tif .tiff, any case); other files are skipped and counted, hidden files and folders ignored.
Each image's header is read with Pillow (no decoding), so a file that is not an image, or whose header is cut short,
is skipped and counted, with up to 5 examples in a warning. A class folder with no usable image is skipped with a
warning naming it, or an error with ``empty_class_policy: error``. Image modes other than RGB are counted and logged
(they are converted when loaded: image_transforms.to_rgb). Missing path, a file instead of a folder, or no usable image
at all: an error that names the path. An image that passed the scan but fails to decode when loaded (truncated data)
is a ``ConfigError`` naming the file; raised in a dataloader worker, it reaches the training loop as the same
exception type.

Data config keys (``data_cfg``, any mapping or OmegaConf DictConfig; unknown keys are an error)::

    path: ???                    folder in one of the layouts above (required); a relative path is looked up from
                                 the working directory, then the recipe folder
    val_fraction: 0.1            layout a: the share of each class held out for validation, in [0, 1)
    micro_batch_size: 32         training images per batch per rank
    val_micro_batch_size: null   validation images per batch per rank (null: micro_batch_size)
    num_workers: 4               dataloader worker processes per loader (0: load in the training process)
    prefetch_factor: 2           batches each worker loads ahead (ignored with num_workers 0)
    mean: [0.5, 0.5, 0.5]        per-channel normalisation of pixels in [0, 1]; 0.5 is Hugging Face ViT's default
    std: [0.5, 0.5, 0.5]         (ImageNet-trained timm/torchvision models use [0.485, 0.456, 0.406] and
                                 [0.229, 0.224, 0.225])
    train_augment: true          random resized crops and flips for training; false: the evaluation transform
                                 (resize, central crop) for training too, e.g. to check that a model can overfit
    empty_class_policy: skip     skip (with a warning) | error: a class folder without a usable image
"""

import logging
import os
import warnings

import numpy as np
import torch
from epoch_batch_sampler import EpochBatchSampler
from image_folder import EMPTY_CLASS_POLICIES, scan_image_folder
from image_transforms import build_transforms
from PIL import Image
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from user_errors import ConfigError


logger = logging.getLogger(__name__)

DEFAULT_DATA_CONFIG = {
    "path": None,
    "val_fraction": 0.1,
    "micro_batch_size": 32,
    "val_micro_batch_size": None,
    "num_workers": 4,
    "prefetch_factor": 2,
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
    "train_augment": True,
    "empty_class_policy": "skip",
}

# ------------------------------------------------------------------------------------------------- dataset


class ImageClassificationDataset(torch.utils.data.Dataset):
    """Map-style dataset of ``(path, class id)`` samples, indexed by ``(epoch, index)`` (what EpochBatchSampler
    yields) or a plain ``index`` (epoch 0). An item is ``{"pixel_values": float32 [3, S, S], "labels": int64 []}``.

    ``transform(pil_image, generator)`` gets a generator seeded from ``(seed, epoch, index)`` alone, so an item is a
    pure function of those: the same in any worker, after any resume, whatever was loaded before it.
    """

    def __init__(self, samples: list[tuple[str, int]], transform, seed: int):
        # One numpy array of byte strings, not a list of str: forked workers would touch every str's reference count
        # and so copy the pages holding a million paths into each worker.
        self.paths = np.array([os.fsencode(path) for path, _ in samples], dtype=bytes)
        self.labels = np.array([label for _, label in samples], dtype=np.int64)
        self.transform, self.seed = transform, int(seed)

    def __len__(self) -> int:
        return len(self.labels)

    def generator(self, epoch: int, index: int) -> torch.Generator:
        """A generator seeded with a hash of (seed, epoch, index): neighbouring samples get unrelated streams."""
        entropy = [self.seed % 2**63, int(epoch), int(index)]
        return torch.Generator().manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]))

    def load(self, index: int) -> Image.Image:
        """The image, fully decoded; a file that fails to decode is a ConfigError naming it."""
        path = os.fsdecode(self.paths[index])
        try:
            with Image.open(path) as image:
                image.load()
        except Exception as error:  # OSError (truncated data), SyntaxError, ValueError, ...: Pillow raises many
            raise ConfigError(
                f"{path}: cannot decode the image ({type(error).__name__}: {error}); its header was fine when the "
                "dataset was scanned, so the file is cut short or damaged: replace or delete it"
            ) from None
        return image

    def __getitem__(self, key) -> dict[str, torch.Tensor]:
        epoch, index = key if isinstance(key, tuple | list) else (0, key)
        pixels = self.transform(self.load(index), self.generator(epoch, index))
        return {"pixel_values": pixels, "labels": torch.tensor(self.labels[index], dtype=torch.int64)}


# ------------------------------------------------------------------------------------------------- config


def _integer(cfg: dict, key: str, minimum: int) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"dataset.{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _three_numbers(cfg: dict, key: str) -> list[float]:
    value = cfg[key]
    try:
        numbers = [float(v) for v in value]
    except (TypeError, ValueError):
        numbers = []
    if len(numbers) != 3 or (key == "std" and min(numbers) <= 0):
        kind = "positive numbers" if key == "std" else "numbers"
        raise ConfigError(f"dataset.{key} must be 3 {kind} (R, G, B, for pixels in [0, 1]), got {value!r}")
    return numbers


def resolve_data_config(data_cfg) -> dict:
    """``data_cfg`` over the defaults, checked; see the module docstring for the keys."""
    cfg = dict(DEFAULT_DATA_CONFIG)
    unknown = sorted(set(data_cfg) - set(cfg))
    if unknown:
        raise ConfigError(f"unknown data config key(s) {unknown}; known keys: {sorted(cfg)}")
    cfg.update({key: data_cfg[key] for key in data_cfg})
    if cfg["path"] in (None, "", "???"):
        raise ConfigError("dataset.path is not set: add dataset.path=<folder of images> to the command")
    try:
        fraction = float(cfg["val_fraction"])
    except (TypeError, ValueError):
        fraction = -1.0
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"dataset.val_fraction must be a number in [0, 1), got {cfg['val_fraction']!r}")
    cfg["val_fraction"] = fraction
    cfg["micro_batch_size"] = _integer(cfg, "micro_batch_size", 1)
    if cfg["val_micro_batch_size"] is None:
        cfg["val_micro_batch_size"] = cfg["micro_batch_size"]
    cfg["val_micro_batch_size"] = _integer(cfg, "val_micro_batch_size", 1)
    cfg["num_workers"] = _integer(cfg, "num_workers", 0)
    cfg["prefetch_factor"] = _integer(cfg, "prefetch_factor", 1)
    cfg["mean"], cfg["std"] = _three_numbers(cfg, "mean"), _three_numbers(cfg, "std")
    if not isinstance(cfg["train_augment"], bool):
        raise ConfigError(f"dataset.train_augment must be true or false, got {cfg['train_augment']!r}")
    if cfg["empty_class_policy"] not in EMPTY_CLASS_POLICIES:
        raise ConfigError(
            f"dataset.empty_class_policy must be one of {EMPTY_CLASS_POLICIES}, got {cfg['empty_class_policy']!r}"
        )
    return cfg


# --------------------------------------------------------------------------------------------- entry point


def create_dataloaders(data_cfg, image_size: int, dp_rank: int, dp_world_size: int, seed: int):
    """``(train_loader, val_loader, class_names)`` of one data-parallel rank (see the module docstring).

    ``seed`` must be the same on every rank: it splits layout a's images, orders the training images and seeds
    the augmentation. ``image_size`` is the model's input size (square).
    """
    cfg = resolve_data_config(data_cfg)
    splits = scan_image_folder(cfg["path"], cfg["val_fraction"], seed, cfg["empty_class_policy"])
    workers = cfg["num_workers"]
    loading = {
        "num_workers": workers,
        "pin_memory": torch.cuda.is_available(),
        "persistent_workers": workers > 0,  # the val loader is iterated at every evaluation: keep its workers
        "prefetch_factor": cfg["prefetch_factor"] if workers > 0 else None,
    }
    train_transform = build_transforms(image_size, cfg["train_augment"], cfg["mean"], cfg["std"])
    train_set = ImageClassificationDataset(splits.train, train_transform, seed)
    sampler = EpochBatchSampler(
        np.arange(len(train_set)),
        shuffle=True,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        micro_batch_size=cfg["micro_batch_size"],
    )
    with warnings.catch_warnings():
        # torchdata calls torch.set_vital, which torch 2.13 deprecates: a warning in every run that no user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        train_loader = StatefulDataLoader(train_set, batch_sampler=sampler, **loading)

    val_loader = None
    if splits.val:
        val_set = ImageClassificationDataset(
            splits.val, build_transforms(image_size, False, cfg["mean"], cfg["std"]), seed
        )
        shard = list(range(dp_rank, len(val_set), dp_world_size))  # every image on exactly one rank, in order
        val_loader = DataLoader(val_set, batch_size=cfg["val_micro_batch_size"], sampler=shard, **loading)
    logger.info(
        f"rank {dp_rank}/{dp_world_size}: {len(train_set) // dp_world_size} training images per epoch in batches of "
        f"{cfg['micro_batch_size']}, {len(val_loader.sampler) if val_loader else 0} validation images; "
        f"{workers} worker(s) per loader, augmentation {'on' if cfg['train_augment'] else 'off'}"
    )
    return train_loader, val_loader, splits.class_names
