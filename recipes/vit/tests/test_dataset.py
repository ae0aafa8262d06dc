"""Finding, checking, splitting and loading image folders (image_folder.py, dataset.py) on tiny trees written per
test, and the synthetic sample set (scripts/make_sample_images.py).

Most images are solid colours whose red value is the image's number (tests/conftest.py), so a batch's pixels say
which images it holds whatever the augmentation did to them."""

import hashlib
import importlib.util
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset import ImageClassificationDataset, create_dataloaders
from image_folder import scan_image_folder
from image_transforms import build_transforms
from PIL import Image
from user_errors import ConfigError, PathNotFoundError, user_error_message


RECIPE = Path(__file__).resolve().parents[1]


def codes_of(pixel_values: torch.Tensor) -> list[int]:
    """The numbers (red values) of the solid-colour images in a batch normalised with mean = std = 0.5."""
    return [int(v) for v in ((pixel_values[:, 0].mean(dim=(1, 2)) * 0.5 + 0.5) * 255).round().tolist()]


def code(path) -> int:
    return int(Path(path).stem)


def loaders(path, rank=0, world=2, seed=0, image_size=8, **overrides):
    cfg = {"path": str(path), "micro_batch_size": 2, "num_workers": 0, **overrides}
    return create_dataloaders(cfg, image_size, dp_rank=rank, dp_world_size=world, seed=seed)


def take(iterator, n: int) -> list[dict]:
    return [next(iterator) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------- layouts


def test_class_folders_are_numbered_alphabetically_and_split_per_class(image_tree):
    root = image_tree({"cat": 10, "ant": 10, "bee": 5})  # written out of order: ids must not follow that
    splits = scan_image_folder(root, val_fraction=0.2, seed=0)
    assert splits.class_names == ["ant", "bee", "cat"]
    for path, label in splits.train + splits.val:
        assert splits.class_names[label] == Path(path).parent.name
    val_per_class = [sum(label == i for _, label in splits.val) for i in range(3)]
    assert val_per_class == [2, 1, 2]  # round(0.2 * 10), round(0.2 * 5)
    assert len(splits.train) == 20
    assert {code(p) for p, _ in splits.train + splits.val} == set(range(25))  # every image once
    *_, class_names = loaders(root, val_fraction=0.2)
    assert class_names == ["ant", "bee", "cat"]


def test_the_split_is_deterministic_disjoint_and_keeps_a_training_image(image_tree):
    root = image_tree({"a": 12, "b": 12, "single": 1, "pair": 2})
    first = scan_image_folder(root, val_fraction=0.5, seed=1)
    again = scan_image_folder(root, val_fraction=0.5, seed=1)
    other = scan_image_folder(root, val_fraction=0.5, seed=2)
    assert first == again and first.val != other.val
    assert not {p for p, _ in first.train} & {p for p, _ in first.val}
    single, pair = first.class_names.index("single"), first.class_names.index("pair")
    assert [label for _, label in first.train].count(single) == 1  # the only image stays for training
    assert [label for _, label in first.train].count(pair) == 1 and [label for _, label in first.val].count(pair) == 1
    assert scan_image_folder(root, val_fraction=0.0, seed=1).val == []
    assert loaders(root, val_fraction=0.0)[1] is None


def test_huggingface_split_folders(image_tree, caplog):
    image_tree({"dog": 3, "cat": 2}, root="hf/train")
    image_tree({"cat": 1}, root="hf/val")
    image_tree({"dog": 1, "cat": 1}, root="hf/test")  # after val/: ignored, with a warning
    with caplog.at_level(logging.INFO):
        splits = scan_image_folder(Path(image_tree({}, root="hf")), val_fraction=0.5, seed=0)
    assert splits.class_names == ["cat", "dog"]
    assert sorted(Path(p).parent.parent.name for p, _ in splits.train) == ["train"] * 5  # val_fraction ignored
    assert [(Path(p).parent.parent.name, label) for p, label in splits.val] == [("val", 0)]
    assert (
        "ignored folder(s) ['test']: beside train/ only the first of validation, val, test" in caplog.text
        and "(train/ and val/)" in caplog.text
    )


def test_huggingface_train_folder_alone_is_split(image_tree):
    image_tree({"dog": 4, "cat": 4}, root="hf/train")
    splits = scan_image_folder(Path(image_tree({}, root="hf")), val_fraction=0.25, seed=0)
    assert len(splits.train) == 6 and len(splits.val) == 2 and splits.class_names == ["cat", "dog"]


def test_validation_classes_must_have_training_images(image_tree):
    image_tree({"cat": 2}, root="hf/train")
    image_tree({"cat": 1, "zebra": 1}, root="hf/validation")
    with pytest.raises(ConfigError, match=r"validation split has class\(es\) \['zebra'\] that have no training"):
        scan_image_folder(Path(image_tree({}, root="hf")))


def test_metadata_csv_with_class_names(write_image, tmp_path):
    names = {"z.png": "zebra", "a.png": "ant", "b.png": "ant", "sub/c.png": "zebra", "d.png": "bee"}
    for k, name in enumerate(names):
        write_image(f"meta/{name}", (k, 0, 0))
    lines = ["file_name,label,notes", *(f"{name},{label},x" for name, label in names.items())]
    (tmp_path / "meta" / "metadata.csv").write_text("\n".join(lines) + "\n")
    splits = scan_image_folder(tmp_path / "meta", val_fraction=0.0)
    assert splits.class_names == ["ant", "bee", "zebra"]
    labelled = {Path(p).relative_to(tmp_path / "meta").as_posix(): label for p, label in splits.train}
    assert labelled == {"a.png": 0, "b.png": 0, "d.png": 1, "z.png": 2, "sub/c.png": 2}


def test_metadata_jsonl_with_integer_labels_per_split(write_image, tmp_path):
    rows = {"train": [("x.png", 2), ("y.png", 0), ("w.png", 2)], "validation": [("v.png", 2)]}
    for split, entries in rows.items():
        for name, _ in entries:
            write_image(f"hf/{split}/{name}")
        text = "".join(json.dumps({"file_name": name, "label": label}) + "\n" for name, label in entries)
        (tmp_path / "hf" / split / "metadata.jsonl").write_text(text)
    splits = scan_image_folder(tmp_path / "hf")
    assert splits.class_names == ["0", "1", "2"]  # integer labels are the ids; 1 has no image
    assert sorted((Path(p).name, label) for p, label in splits.train) == [("w.png", 2), ("x.png", 2), ("y.png", 0)]
    assert [(Path(p).name, label) for p, label in splits.val] == [("v.png", 2)]


def test_root_metadata_with_split_folders(write_image, tmp_path):
    for name in ("train/a.png", "train/b.png", "validation/c.png"):
        write_image(f"hf/{name}")
    text = "file_name,label\ntrain/a.png,cat\ntrain/b.png,dog\nvalidation/c.png,dog\n"
    (tmp_path / "hf" / "metadata.csv").write_text(text)
    splits = scan_image_folder(tmp_path / "hf")
    assert [(Path(p).name, label) for p, label in splits.train] == [("a.png", 0), ("b.png", 1)]
    assert [(Path(p).name, label) for p, label in splits.val] == [("c.png", 1)]


def test_broken_metadata_is_named(write_image, tmp_path):
    write_image("meta/a.png")
    metadata = tmp_path / "meta" / "metadata.csv"
    metadata.write_text("file_name,class\na.png,cat\n")
    with pytest.raises(ConfigError, match=re.escape(f"{metadata}: no column label")):
        scan_image_folder(tmp_path / "meta")
    metadata.write_text("file_name,label\na.png,cat\nmissing.png,cat\n")
    with pytest.raises(ConfigError, match=re.escape(f"{metadata} line 3: file_name 'missing.png' names no file")):
        scan_image_folder(tmp_path / "meta")
    metadata.unlink()
    (tmp_path / "meta" / "metadata.jsonl").write_text('{"file_name": "a.png", "label": -1}\n')
    with pytest.raises(ConfigError, match="line 1: label -1 is neither a class name nor a class id"):
        scan_image_folder(tmp_path / "meta")


# ------------------------------------------------------------------------------------------- what is skipped


def test_non_images_are_skipped_and_counted(image_tree, tmp_path, caplog):
    root = image_tree({"cat": 2, "dog": 2})
    (root / "cat" / "fake.png").write_text("<html>not found</html>")
    (root / "dog" / "cut.PNG").write_bytes((root / "dog" / "002.png").read_bytes()[:20])  # inside the header
    (root / "dog" / "notes.txt").write_text("hello")
    (root / "dog" / ".hidden.png").write_text("hidden files are not even counted")
    with caplog.at_level(logging.INFO):
        splits = scan_image_folder(root, val_fraction=0.0)
    assert sorted(code(p) for p, _ in splits.train) == [0, 1, 2, 3]
    assert "skipped 2 file(s) with an image extension that Pillow cannot read" in caplog.text
    assert str(root / "cat" / "fake.png") in caplog.text and str(root / "dog" / "cut.PNG") in caplog.text
    assert "skipped 1 non-image file(s)" in caplog.text and "notes.txt" in caplog.text
    assert ".hidden" not in caplog.text
    assert any(r.levelno == logging.WARNING and "fake.png" in r.message for r in caplog.records)


def test_an_empty_class_folder_is_skipped_with_a_warning(image_tree, caplog):
    root = image_tree({"cat": 2, "dog": 2})
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "x.jpg").write_text("not a jpeg")
    with caplog.at_level(logging.WARNING):
        splits = scan_image_folder(root, val_fraction=0.0)
    assert splits.class_names == ["cat", "dog"]
    assert "skipped 2 class folder(s) without a usable image" in caplog.text
    assert str(root / "empty") in caplog.text and str(root / "broken") in caplog.text
    with pytest.raises(ConfigError, match=re.escape(str(root / "broken"))):
        scan_image_folder(root, empty_class_policy="error")


def test_no_usable_image_is_an_error(tmp_path, write_image):
    (tmp_path / "nothing" / "cat").mkdir(parents=True)
    (tmp_path / "nothing" / "cat" / "readme.txt").write_text("no images here")
    with pytest.raises(ConfigError, match=r"dataset.path=\S+nothing: no usable training image"):
        loaders(tmp_path / "nothing")
    write_image("flat/a.png")  # images, but no class folder to name their class
    with pytest.raises(ConfigError, match="no usable training image"):
        scan_image_folder(tmp_path / "flat")


def test_missing_path_and_file_path_are_named(tmp_path, write_image):
    with pytest.raises(PathNotFoundError, match=r"dataset.path=\S+nowhere: no such folder; point dataset.path"):
        loaders(tmp_path / "nowhere")
    image = write_image("a.png")
    with pytest.raises(ConfigError, match=r"dataset.path=\S+a.png is a file, not a folder; point dataset.path"):
        loaders(image)


def test_unknown_and_invalid_config_values(image_tree):
    root = image_tree({"cat": 2})
    with pytest.raises(ConfigError, match=r"unknown data config key\(s\) \['batch_size'\]; known keys: .*micro_batch"):
        loaders(root, batch_size=4)
    for key, value in [("micro_batch_size", 0), ("val_fraction", 1.0), ("std", [0.5, 0.0, 0.5]), ("mean", [0.5]),
                       ("empty_class_policy", "ignore"), ("train_augment", "yes"), ("num_workers", -1)]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"dataset.{key}"):
            loaders(root, **{key: value})
    with pytest.raises(ConfigError, match="dataset.path is not set"):
        create_dataloaders({"path": "???"}, 8, 0, 1, 0)


# --------------------------------------------------------------------------------------------------- loading


def test_other_modes_and_formats_load_as_rgb(tmp_path, write_image, caplog):
    written = {
        "gray/a.png": ("L", (100, 100, 100), (100, 100, 100)),
        "rgba/b.png": ("RGBA", (10, 20, 30), (10, 20, 30)),  # opaque here: Pillow's RGB -> RGBA
        "palette/c.gif": ("P", (255, 0, 0), (255, 0, 0)),
        "cmyk/d.tif": ("CMYK", (0, 0, 255), (0, 0, 255)),
        "rgb/e.BMP": ("RGB", (1, 2, 3), (1, 2, 3)),
        "rgb/f.webp": ("RGB", (40, 50, 60), None),  # lossy: only the shape is checked
    }
    for name, (mode, color, _) in written.items():
        write_image(f"modes/{name}", color, mode=mode)
    Image.new("I;16", (12, 10), 32896).save(tmp_path / "modes" / "gray" / "g.png")  # 16-bit: 128 in 8 bits
    with caplog.at_level(logging.INFO):
        splits = scan_image_folder(tmp_path / "modes", val_fraction=0.0)
    assert re.search(r"converted to RGB when loaded: .*1 16-bit grayscale \(I;16\)", caplog.text)
    assert "1 CMYK" in caplog.text and "1 grayscale (L)" in caplog.text and "1 palette (P)" in caplog.text
    dataset = ImageClassificationDataset(splits.train, build_transforms(8, train=False), seed=0)
    expected = {Path(n).name: rgb for n, (_, _, rgb) in written.items()} | {"g.png": (128, 128, 128)}
    for index, (path, _) in enumerate(splits.train):
        item = dataset[index]
        assert item["pixel_values"].shape == (3, 8, 8) and item["pixel_values"].dtype == torch.float32
        assert item["labels"].dtype == torch.int64 and item["labels"].shape == ()
        if expected[Path(path).name] is not None:
            rgb = (item["pixel_values"].mean(dim=(1, 2)) * 0.5 + 0.5) * 255
            assert rgb.round().tolist() == list(expected[Path(path).name]), path


def test_an_image_cut_short_after_its_header_fails_by_name_when_loaded(tmp_path, write_image):
    for k in range(4):
        write_image(f"data/cat/{k}.png", texture_seed=k, size=(64, 64))
    broken = tmp_path / "data" / "cat" / "2.png"
    broken.write_bytes(broken.read_bytes()[:300])  # the header is whole, the pixel data is not
    splits = scan_image_folder(tmp_path / "data", val_fraction=0.0)
    assert len(splits.train) == 4  # the header check passes it
    dataset = ImageClassificationDataset(splits.train, build_transforms(8, train=True), seed=0)
    with pytest.raises(ConfigError, match=re.escape(f"{broken}: cannot decode the image")):
        dataset[(0, 2)]
    train, _, _ = loaders(tmp_path / "data", world=1, val_fraction=0.0, micro_batch_size=4, num_workers=1)
    with pytest.raises(ConfigError, match=re.escape(str(broken))) as raised:  # from the worker, as the same type
        next(iter(train))
    line = user_error_message(raised.value)  # what the entrypoint prints: the worker's traceback left out
    assert line.startswith(f"{broken}: cannot decode the image") and "\n" not in line


def test_augmentation_is_a_pure_function_of_seed_epoch_and_index(image_tree):
    root = image_tree({"cat": 3}, textured=True)
    splits = scan_image_folder(root, val_fraction=0.0)
    dataset = ImageClassificationDataset(splits.train, build_transforms(8, train=True), seed=5)
    first = dataset[(0, 1)]["pixel_values"]
    assert torch.equal(first, dataset[(0, 1)]["pixel_values"])
    assert not torch.equal(first, dataset[(1, 1)]["pixel_values"])  # another epoch, another crop
    other_seed = ImageClassificationDataset(splits.train, build_transforms(8, train=True), seed=6)
    assert not torch.equal(first, other_seed[(0, 1)]["pixel_values"])


def test_train_loader_is_endless_and_shards_disjointly(image_tree):
    root = image_tree({"cat": 6, "dog": 5})  # 11 images: 5 per rank and epoch, one left over
    seen = {}
    for rank in (0, 1):
        train, _, _ = loaders(root, rank=rank, val_fraction=0.0)
        batches = take(iter(train), 9)  # 3 epochs of 2 + 2 + 1 images
        assert [len(b["labels"]) for b in batches] == [2, 2, 1] * 3
        codes = [codes_of(b["pixel_values"]) for b in batches]
        epochs = [sum(codes[3 * e : 3 * e + 3], []) for e in range(3)]
        assert all(len(set(epoch)) == 5 for epoch in epochs)
        for b, batch_codes in zip(batches, codes):
            assert b["labels"].tolist() == [int(c >= 6) for c in batch_codes]  # cat: images 0-5, dog: 6-10
        assert epochs[0] != epochs[1]  # reshuffled
        seen[rank] = epochs
    for epoch in range(3):
        assert not set(seen[0][epoch]) & set(seen[1][epoch])
        assert len(set(seen[0][epoch]) | set(seen[1][epoch])) == 10


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_yields_the_same_batches_bit_for_bit(image_tree, tmp_path, num_workers):
    root = image_tree({"cat": 5, "dog": 5}, textured=True)  # textured: a different crop gives different pixels

    def make():
        return loaders(root, world=1, val_fraction=0.0, micro_batch_size=3, num_workers=num_workers)[0]

    loader = make()
    iterator = iter(loader)
    take(iterator, 3)
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    expected = take(iterator, 5)  # the end of epoch 0 and into epoch 1
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=True))
    got = take(iter(resumed), 5)
    for want, have in zip(expected, got):
        assert torch.equal(want["labels"], have["labels"])
        assert torch.equal(want["pixel_values"], have["pixel_values"])
    assert [len(b["labels"]) for b in expected] == [1, 3, 3, 3, 1]


def test_val_loaders_of_two_ranks_cover_every_image_once(image_tree):
    root = image_tree({"ant": 5, "bee": 5, "cat": 5})
    splits = scan_image_folder(root, val_fraction=0.4, seed=3)
    seen = []
    for rank in (0, 1):
        _, val, _ = loaders(root, rank=rank, seed=3, val_fraction=0.4, val_micro_batch_size=2)
        for batch in val:
            assert batch["pixel_values"].shape[1:] == (3, 8, 8)
            codes = codes_of(batch["pixel_values"])
            assert batch["labels"].tolist() == [c // 5 for c in codes]
            seen += codes
    assert sorted(seen) == sorted(code(p) for p, _ in splits.val) and len(seen) == 6


# ----------------------------------------------------------------------------------------------- sample set


def load_script():
    spec = importlib.util.spec_from_file_location("make_sample_images", RECIPE / "scripts" / "make_sample_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.png")
    }


def test_sample_images_are_deterministic_and_show_their_class(tmp_path):
    make = load_script().make_sample_images
    first = digest(make(tmp_path / "a", per_class=4))
    assert first == digest(make(tmp_path / "b", per_class=4)) and len(first) == 16
    assert first != digest(make(tmp_path / "c", per_class=4, seed=1))
    splits = scan_image_folder(tmp_path / "a", val_fraction=0.25)
    assert splits.class_names == ["checker", "diamond", "horizontal", "vertical"]
    for name in ("horizontal", "vertical"):  # stripes change colour across their edges, not along them
        for path in (tmp_path / "a" / name).glob("*.png"):
            pixels = np.asarray(Image.open(path), dtype=np.float64)  # [rows, columns, RGB]
            across_rows = pixels.mean(axis=1).var(axis=0).sum()  # how much the rows' mean colours differ
            across_columns = pixels.mean(axis=0).var(axis=0).sum()
            ratio = across_rows / across_columns if name == "horizontal" else across_columns / across_rows
            assert ratio > 5, path  # over 17 in 2,000 images of each class
