"""Which images, which classes, which split: scan an image folder for dataset.py.

``scan_image_folder(path, val_fraction, seed, empty_class_policy)`` finds the images of ``dataset.path`` in one of the
layouts that dataset.py's docstring lists (class folders; Hugging Face imagefolder splits; metadata.csv/jsonl),
checks each image's header, numbers the classes and splits the images into training and validation sets. It logs
one summary line (layout, classes, images, what was skipped, which modes will be converted to RGB) and a warning for
each kind of problem it stepped over.

Why read every header: a file with an image extension that is not an image (an HTML error page saved as .jpg, a
half-copied file) would otherwise fail hours into a run, in a dataloader worker. Reading a header opens the file and
parses a few hundred bytes, nothing is decoded; threads overlap the waiting on network file systems. Every rank scans
for itself (the result is the same on each), as every rank of the other recipes reads its data files.

Why a per-class split seeded by the class name too: adding a class (or images of another class) leaves the
train/validation split of every other class as it was.
"""

import csv
import json
import logging
import os
import sys
import zlib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from recipe_paths import recipe_path
from tqdm import tqdm
from user_errors import ConfigError, PathNotFoundError


logger = logging.getLogger(__name__)

EMPTY_CLASS_POLICIES = ("skip", "error")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
VAL_SPLITS = ("validation", "val", "test")  # the first present is the validation split (layout b)
METADATA_FILES = ("metadata.csv", "metadata.jsonl")
MODE_NAMES = {"1": "1-bit", "L": "grayscale", "LA": "grayscale+alpha", "P": "palette", "PA": "palette+alpha",
              "I;16": "16-bit grayscale", "I": "32-bit grayscale", "F": "float grayscale"}  # fmt: skip
EXAMPLES = 5  # paths named in a warning
PROGRESS_BAR_FROM = 1000  # images: below this, scanning takes about a second and a bar would only flicker
LAYOUT_HELP = (
    "point dataset.path at a folder of class folders (root/<class>/<image>), a Hugging Face imagefolder "
    "(root/train/<class>/..., root/validation/<class>/...) or a folder with metadata.csv/metadata.jsonl "
    "(columns file_name, label); python scripts/make_sample_images.py OUT_DIR writes a small one"
)

# ------------------------------------------------------------------------------------------------ scanning


@dataclass
class ScanLog:
    """What scanning skipped and saw, over all splits: reported once at the end."""

    not_images: list[Path] = field(default_factory=list)  # other extensions
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # image extension, header Pillow can't read
    modes: Counter = field(default_factory=Counter)
    outside_classes: list[Path] = field(default_factory=list)  # images directly in a folder of class folders
    empty_classes: list[str] = field(default_factory=list)


def _visible_files(folder: Path) -> list[Path]:
    """Every file below ``folder``, sorted, without hidden files or anything inside hidden folders."""
    found = []
    for directory, subfolders, files in os.walk(folder, followlinks=True):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        found += [Path(directory, name) for name in sorted(files) if not name.startswith(".")]
    return found


def _is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def _header_mode(path: Path) -> str | Exception:
    """The image's mode from its header (nothing is decoded), or why Pillow cannot read it."""
    try:
        with Image.open(path) as image:
            return image.mode
    except Exception as error:  # Pillow raises many types here: UnidentifiedImageError, OSError, SyntaxError, ...
        return error


def _check_headers(items: list[tuple[Path, object]], log: ScanLog, split: str) -> list[tuple[Path, object]]:
    """The ``(path, label)`` items whose header Pillow reads; the rest are recorded in ``log``."""
    paths = [path for path, _ in items]
    # Threads: on a network file system opening a file is mostly waiting. The bar only goes to a terminal.
    bar = tqdm(total=len(paths), desc=f"reading {split} image headers", unit="img", leave=False,
               disable=not sys.stderr.isatty() or len(paths) < PROGRESS_BAR_FROM)  # fmt: skip
    usable = []
    with ThreadPoolExecutor(max_workers=min(16, 2 * (os.cpu_count() or 1))) as pool, bar:
        for item, mode in zip(items, pool.map(_header_mode, paths)):
            bar.update()
            if isinstance(mode, Exception):
                log.unreadable.append((item[0], f"{type(mode).__name__}: {mode}"))
            else:
                log.modes[mode] += 1
                usable.append(item)
    return usable


def _class_folder_items(folder: Path, log: ScanLog) -> tuple[list[tuple[Path, str]], list[str]]:
    """Candidate images of ``folder/<class>/...`` labelled with their class name, and the class folders' names."""
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    items = []
    for name in classes:
        for path in _visible_files(folder / name):
            if _is_image_name(path):
                items.append((path, name))
            else:
                log.not_images.append(path)
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            (log.outside_classes if _is_image_name(path) else log.not_images).append(path)
    return items, classes


def _metadata_items(metadata: Path, base: Path, rows, log: ScanLog) -> list[tuple[Path, object]]:
    """Candidate images of metadata ``rows`` (``(line, file_name, label)``), paths taken from ``base``."""
    items = []
    for line, file_name, label in rows:
        path = base / file_name
        if not path.is_file():
            raise ConfigError(
                f"{metadata} line {line}: file_name {file_name!r} names no file ({path}); fix the row or restore "
                "the image"
            )
        if _is_image_name(path):
            items.append((path, label))
        else:
            log.not_images.append(path)
    return items


def _read_split(folder: Path, root_metadata: tuple[Path, list] | None, log: ScanLog, policy: str):
    """The usable ``(path, label)`` images of one split folder (or of the root in layouts a and c)."""
    metadata = find_metadata_file(folder)
    if metadata is not None:
        items, classes = _metadata_items(metadata, folder, read_metadata(metadata), log), []
    elif root_metadata is not None:  # root/metadata.* with split folders: this split's rows are folder/...
        file, rows = root_metadata
        prefix = folder.name + "/"
        rows = [(line, name[len(prefix) :], label) for line, name, label in rows if name.startswith(prefix)]
        items, classes = _metadata_items(file, folder, rows, log), []
    else:
        items, classes = _class_folder_items(folder, log)
    usable = _check_headers(items, log, folder.name)
    found = {label for _, label in usable}
    empty = [name for name in classes if name not in found]
    if empty and policy == "error":
        raise ConfigError(
            f"class folder(s) without a usable image: {', '.join(str(folder / name) for name in empty)}; add "
            "images, remove the folder(s), or set dataset.empty_class_policy=skip"
        )
    log.empty_classes += [str(folder / name) for name in empty]
    return usable


def find_metadata_file(folder: Path) -> Path | None:
    """``folder``'s metadata.csv or metadata.jsonl (layout c), if it has one."""
    found = [folder / name for name in METADATA_FILES if (folder / name).is_file()]
    if len(found) > 1:
        raise ConfigError(f"{folder} holds both metadata.csv and metadata.jsonl; keep one of them")
    return found[0] if found else None


def read_metadata(file: Path) -> list[tuple[int, str, str | int]]:
    """The rows ``(line, file_name, label)`` of a metadata.csv or metadata.jsonl. CSV labels that are all digits
    become integer class ids (JSON says which labels are numbers itself)."""
    if file.suffix == ".csv":
        with open(file, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = [column for column in ("file_name", "label") if column not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(
                    f"{file}: no column {' or '.join(missing)}; its columns are {reader.fieldnames}: a metadata file "
                    "needs file_name (the image's path from this folder) and label (a class name or id)"
                )
            rows = [(number + 2, row["file_name"], row["label"]) for number, row in enumerate(reader)]
        if rows and all(isinstance(label, str) and label.strip().isdigit() for *_, label in rows):
            rows = [(line, name, int(label)) for line, name, label in rows]
    else:
        rows = []
        for line, text in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{file} line {line}: not a JSON object ({error})") from None
            if not isinstance(row, dict) or "file_name" not in row or "label" not in row:
                raise ConfigError(f"{file} line {line}: needs the keys file_name and label, got {text.strip()[:100]}")
            rows.append((line, row["file_name"], row["label"]))
    for line, name, label in rows:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{file} line {line}: file_name {name!r} is not a path")
        if (
            isinstance(label, bool)
            or not isinstance(label, int | str)
            or label == ""
            or (isinstance(label, int) and label < 0)
        ):
            raise ConfigError(
                f"{file} line {line}: label {label!r} is neither a class name nor a class id (an integer >= 0); "
                "every image needs its class (a split without labels, -1, cannot be the validation split)"
            )
    return rows


def _split_by_class(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Hold out ``val_fraction`` of each class (rounded; at least one image stays for training)."""
    by_class = defaultdict(list)
    for path, label in items:
        by_class[label].append(path)
    train, val = [], []
    for label in sorted(by_class, key=str):
        paths = sorted(by_class[label])
        # Seeded by the class too, so adding a class leaves the other classes' splits as they were.
        rng = np.random.default_rng([seed % 2**63, zlib.crc32(str(label).encode())])
        held_out = set(rng.permutation(len(paths))[: min(round(len(paths) * val_fraction), len(paths) - 1)].tolist())
        for i, path in enumerate(paths):
            (val if i in held_out else train).append((path, label))
    return train, val


def _class_ids(train: list, val: list, root: Path) -> tuple[list, list, list[str]]:
    """Number the classes (sorted names, or the integer labels themselves) and label every image with its id."""
    labels = {label for _, label in train}
    if len({isinstance(label, int) for _, label in train + val}) > 1:
        raise ConfigError(f"{root}: the labels mix class names and integer class ids; use one kind for all images")
    if all(isinstance(label, int) for label in labels):
        names, ids = [str(i) for i in range(max(labels) + 1)], {label: label for label in labels}
    else:
        names = sorted(labels)
        ids = {name: i for i, name in enumerate(names)}
    unknown = sorted({label for _, label in val if label not in ids}, key=str)
    if unknown:
        raise ConfigError(
            f"{root}: the validation split has class(es) {unknown[:EXAMPLES]} that have no training image; add "
            "training images of them or take them out of the validation split"
        )
    return [(str(p), ids[label]) for p, label in train], [(str(p), ids[label]) for p, label in val], names


@dataclass
class ImageSplits:
    """Training and validation images as ``(path, class id)``, and the class names by id."""

    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    class_names: list[str]


def _example_list(items) -> str:
    return "; ".join(str(item) for item in items[:EXAMPLES]) + ("; ..." if len(items) > EXAMPLES else "")


def _report(log: ScanLog) -> str:
    """Warn about what was skipped; return the summary's tail (skipped files, modes to convert)."""
    if log.unreadable:
        logger.warning(
            f"skipped {len(log.unreadable)} file(s) with an image extension that Pillow cannot read as an image "
            f"(not an image, or a cut-short header): {_example_list([f'{p} ({why})' for p, why in log.unreadable])}"
        )
    if log.empty_classes:
        logger.warning(f"skipped {len(log.empty_classes)} class folder(s) without a usable image: {log.empty_classes}")
    if log.outside_classes:
        logger.warning(
            f"ignored {len(log.outside_classes)} image(s) outside any class folder (a class is the folder an image "
            f"is in: root/<class>/<image>): {_example_list(log.outside_classes)}"
        )
    tail = f"skipped {len(log.not_images)} non-image file(s)"
    tail += f" ({_example_list(log.not_images)})" if log.not_images else ""
    tail += f" and {len(log.unreadable)} unreadable image(s)"
    converted = [f"{n} {MODE_NAMES.get(m, m)}" + (f" ({m})" if m in MODE_NAMES else "")
                 for m, n in sorted(log.modes.items()) if m != "RGB"]  # fmt: skip
    return tail + (f"; converted to RGB when loaded: {', '.join(converted)}" if converted else "")


def scan_image_folder(path, val_fraction: float = 0.1, seed: int = 0, empty_class_policy: str = "skip") -> ImageSplits:
    """Find, check and split the images of ``path`` (a layout of dataset.py's docstring); log what was found."""
    root = recipe_path(str(path))
    if not root.exists():
        raise PathNotFoundError(f"dataset.path={path}: no such folder; {LAYOUT_HELP}")
    if not root.is_dir():
        raise ConfigError(
            f"dataset.path={path} is a file, not a folder; point dataset.path at the folder that holds the class "
            "folders, the train/ and validation/ folders, or metadata.csv/metadata.jsonl"
        )
    log = ScanLog()
    metadata = find_metadata_file(root)
    if (root / "train").is_dir():
        val_dir = next((root / name for name in VAL_SPLITS if (root / name).is_dir()), None)
        root_rows = (metadata, read_metadata(metadata)) if metadata else None
        train = _read_split(root / "train", root_rows, log, empty_class_policy)
        others = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        others = [name for name in others if name not in ("train", val_dir and val_dir.name)]
        if others:
            logger.warning(
                f"{root}: ignored folder(s) {others}: beside train/ only the first of {', '.join(VAL_SPLITS)} is read"
            )
        if val_dir is not None:
            val, layout = _read_split(val_dir, root_rows, log, empty_class_policy), f"train/ and {val_dir.name}/"
        else:
            train, val = _split_by_class(train, val_fraction, seed)
            layout = f"train/ split by val_fraction {val_fraction} with seed {seed}"
    else:
        train, val = _split_by_class(_read_split(root, None, log, empty_class_policy), val_fraction, seed)
        source = metadata.name if metadata else "class folders"
        layout = f"{source} split by val_fraction {val_fraction} with seed {seed}"
    tail = _report(log)
    if not train:
        raise ConfigError(f"dataset.path={path}: no usable training image ({tail}); {LAYOUT_HELP}")
    train, val, class_names = _class_ids(train, val, root)
    logger.info(f"dataset.path={path} ({layout}): {len(class_names)} classes, {len(train)} train and {len(val)} "
                f"val images; {tail}")  # fmt: skip
    return ImageSplits(train, val, class_names)
