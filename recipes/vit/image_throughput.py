"""Throughput accounting for images, through the perf logger every recipe shares (perf_logger.py counts tokens).

Every image is one sequence of ``tokens_per_image`` tokens (patches + class token), so a micro-batch of ``B`` images
is counted as a ``[B, tokens_per_image]`` grid of real tokens: the logger's tokens/s and MFU (with the attention term
of ``tokens_per_image ** 2`` per image) then hold for a ViT as for a language model. Images per second are tokens per
second divided by ``tokens_per_image``; ``add_images_per_second`` writes them into ``summary.json``.
"""

import json
from pathlib import Path

import torch


def token_grid(images: int, tokens_per_image: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What ``PerfLogger.count_batch`` reads of a micro-batch of ``images`` images: all tokens real, none padded."""
    return {"input_ids": torch.ones(images, tokens_per_image, dtype=torch.int8, device=device)}


def add_images_per_second(summary: dict | None, output_dir: str | Path, tokens_per_image: int) -> None:
    """Add ``median_images_per_second_per_gpu`` to the summary ``PerfLogger.finish`` returned (rank 0; None
    elsewhere) and to the ``summary.json`` it wrote."""
    if summary is None:
        return
    tokens = summary.get("median_tokens_per_second_per_gpu")
    summary["tokens_per_image"] = tokens_per_image
    summary["median_images_per_second_per_gpu"] = tokens / tokens_per_image if tokens is not None else None
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
