"""Classify a folder of images with an exported ViT and write the predictions as CSV.

    python infer.py --model outputs/L0_sanity/best_model --images /data/new_images --output predictions.csv
    python infer.py --model outputs/vit_base/final_model --images photo.jpg --top-k 5 --output -      # to stdout

``--model`` is any export of this recipe (``final_model``, ``best_model``) or of ``models/vit``. Images are prepared
the way validation prepared them during training (image_transforms.py: resize the shorter side, central crop,
normalise with the mean and std the export's ``preprocessor_config.json`` records; for this recipe's exports that file
describes the same steps, so ``AutoImageProcessor`` prepares images alike: model_setup.image_processor). Every image
file below ``--images`` is read (sorted; hidden files skipped). A file that is not an image, or that fails to decode,
is skipped and counted, and the log names up to five of them; the run goes on.

CSV columns: ``path`` (as found below ``--images``), then for rank ``k`` = 1..top-k: ``label_k`` (the class name the
model was trained with), ``class_id_k`` and ``probability_k`` (softmax).
"""

import argparse
import csv
import json
import logging
import sys
from pathlib import Path

import torch
from image_folder import IMAGE_EXTENSIONS
from image_transforms import build_transforms
from PIL import Image
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForImageClassification
from user_errors import ConfigError, PathNotFoundError, run


logger = logging.getLogger(__name__)
EXAMPLES = 5


def image_files(images: Path) -> list[Path]:
    """``images`` itself if it is a file, else every image file below it (by extension), sorted, hidden ones skipped."""
    if images.is_file():
        return [images]
    if not images.is_dir():
        raise PathNotFoundError(f"--images {images} does not exist; give an image file or a folder of images")
    files = sorted(
        path
        for path in images.rglob("*")
        if path.is_file()
        and path.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in path.relative_to(images).parts)
    )
    if not files:
        raise ConfigError(f"--images {images} holds no image file ({', '.join(IMAGE_EXTENSIONS)})")
    return files


def load_model(model_dir: Path, device: torch.device):
    """The export on ``device`` (TE on a GPU with TE, else the torch backend), and its preprocessing settings."""
    if not (model_dir / "config.json").is_file():
        raise PathNotFoundError(f"--model {model_dir} is not an exported model (no config.json there)")
    backend = "auto" if device.type == "cuda" else "torch"
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True, backend=backend)
    model = AutoModelForImageClassification.from_pretrained(model_dir, config=config, trust_remote_code=True)
    processor_file = model_dir / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    mean, std = processor.get("image_mean", [0.5, 0.5, 0.5]), processor.get("image_std", [0.5, 0.5, 0.5])
    return model.to(device).eval(), build_transforms(config.image_size, train=False, mean=mean, std=std)


@torch.no_grad()
def classify(model, transform, files: list[Path], batch_size: int, top_k: int, device: torch.device):
    """Yield ``(path, [(class id, probability)] * top_k)`` per readable image; unreadable ones are counted."""
    skipped = []
    bar = tqdm(total=len(files), desc="classify", unit="img", disable=not sys.stderr.isatty())
    for start in range(0, len(files), batch_size):
        batch_files, pixels = [], []
        for path in files[start : start + batch_size]:
            try:
                with Image.open(path) as image:
                    image.load()
                    pixels.append(transform(image))
                batch_files.append(path)
            except Exception as error:  # Pillow raises many types for broken files
                skipped.append((path, f"{type(error).__name__}: {error}"))
        bar.update(len(files[start : start + batch_size]))
        if not pixels:
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(torch.stack(pixels).to(device)).logits.float()
        probabilities, class_ids = logits.softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)
        for path, ids, probs in zip(batch_files, class_ids.tolist(), probabilities.tolist()):
            yield path, list(zip(ids, probs))
    bar.close()
    if skipped:
        examples = "; ".join(f"{path} ({why})" for path, why in skipped[:EXAMPLES])
        logger.warning("Skipped %d file(s) that could not be read as images, e.g. %s", len(skipped), examples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="an exported model directory")
    parser.add_argument("--images", required=True, type=Path, help="an image file, or a folder searched recursively")
    parser.add_argument("--output", required=True, help="CSV file to write, or - for standard output")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=1, help="how many classes to list per image")
    parser.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda | cuda:N")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.batch_size < 1 or args.top_k < 1:
        raise ConfigError("--batch-size and --top-k must be at least 1")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)

    files = image_files(args.images)
    model, transform = load_model(args.model, device)
    id2label = model.config.id2label
    top_k = min(args.top_k, model.config.num_labels)
    header = ["path"] + [f"{name}_{k}" for k in range(1, top_k + 1) for name in ("label", "class_id", "probability")]
    output = sys.stdout if args.output == "-" else open(args.output, "w", newline="")  # noqa: SIM115
    written = 0
    try:
        writer = csv.writer(output)
        writer.writerow(header)
        for path, ranked in classify(model, transform, files, args.batch_size, top_k, device):
            row = [str(path.relative_to(args.images)) if args.images.is_dir() else str(path)]
            for class_id, probability in ranked:
                row += [id2label.get(class_id, str(class_id)), class_id, f"{probability:.6f}"]
            writer.writerow(row)
            written += 1
    finally:
        if output is not sys.stdout:
            output.close()
    logger.info("Classified %d of %d image file(s) with %s -> %s", written, len(files), args.model, args.output)


if __name__ == "__main__":
    run(main)
