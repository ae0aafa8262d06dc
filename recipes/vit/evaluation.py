"""Validation during training (loss and top-1 accuracy over the whole validation split) and the best model by
validation accuracy, kept as an export.

``evaluate`` runs every rank through the same number of forward passes: the sharded strategies (FSDP2,
Megatron-FSDP) gather weights in each forward, a collective, so a rank with fewer validation images than another
runs extra passes on an empty stand-in batch whose results count for nothing. The sums are all-reduced, so every rank
gets the same numbers and makes the same decisions with them.

``BestModel`` writes ``<output_dir>/best_model``, a Hugging Face export like ``final_model``, whenever validation
accuracy beats every earlier validation of the run (resumed runs included: the accuracy to beat is read back from
``best_model/validation.json``). It is never pruned, and replaced only once the new export is complete.
"""

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint import export_final_model, gather_full_state_dict
from distributed import move_to_device
from perf_logger import drop_metrics_after


logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, val_loader, device: torch.device, autocast_bf16: bool = False, group=None
) -> dict:
    """``{"loss", "accuracy", "images"}`` over the whole validation split (every rank's share), in eval mode.
    ``autocast_bf16``: compute under ``torch.autocast`` (DDP's bf16 over fp32 weights; the FSDP strategies cast the
    weights themselves). ``group``: the data-parallel ranks to sum over (None: all); with tensor parallelism the ranks
    splitting one model see the same images, so each sums only with the ranks that hold its share."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss * images, correct, images
    batches = iter(val_loader)
    passes = torch.tensor(len(val_loader), device=device)
    if dist.is_initialized():
        dist.all_reduce(passes, op=dist.ReduceOp.MAX, group=group)
    for _ in range(int(passes)):
        batch, weight = next(batches, None), 1.0
        if batch is None:  # this rank's share is used up: an empty-handed pass keeps the collectives in step
            size = _image_size(model)
            batch = {"pixel_values": torch.zeros(1, 3, size, size), "labels": torch.zeros(1, dtype=torch.long)}
            weight = 0.0
        batch = move_to_device(batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            output = model(**batch)
        images = batch["labels"].numel()
        sums[0] += weight * output.loss.double() * images
        sums[1] += weight * (output.logits.argmax(-1) == batch["labels"]).sum()
        sums[2] += weight * images
    if dist.is_initialized():
        dist.all_reduce(sums, group=group)
    model.train(was_training)
    loss_sum, correct, images = sums.tolist()
    if images == 0:
        return {"loss": float("nan"), "accuracy": float("nan"), "images": 0}
    return {"loss": loss_sum / images, "accuracy": correct / images, "images": int(images)}


def _image_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None) or model.module.config
    return config.image_size


class ValidationLog:
    """``validation.jsonl`` in the output directory: one line per validation, rewritten on resume (steps after the
    resumed checkpoint are validated again)."""

    def __init__(self, output_dir: str | Path, start_step: int):
        self.path = Path(output_dir) / "validation.jsonl"
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if self.rank0 and start_step > 0:
            drop_metrics_after(self.path, start_step)

    def write(self, step: int, metrics: dict) -> None:
        if not self.rank0:
            return
        logger.info(
            "validation step %d | loss %.4f | accuracy %.2f%% | %d images",
            step,
            metrics["loss"],
            100 * metrics["accuracy"],
            metrics["images"],
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, **metrics}) + "\n")


class BestModel:
    """Keeps ``directory`` the export of the model with the best validation accuracy so far."""

    def __init__(self, directory: str | Path, strategy: str, image_processor=None):
        self.directory, self.strategy, self.image_processor = Path(directory), strategy, image_processor
        record = self.directory / "validation.json"
        self.best = json.loads(record.read_text()) if record.is_file() else None

    @property
    def accuracy(self) -> float:
        return self.best["accuracy"] if self.best else float("-inf")

    def update(self, step: int, metrics: dict, model: torch.nn.Module) -> bool:
        """Export ``model`` if ``metrics`` beat the best so far; collective (every rank calls it, and all decide alike
        because the metrics are all-reduced)."""
        if not metrics["images"] or not metrics["accuracy"] > self.accuracy:
            return False
        full_state_dict = gather_full_state_dict(model, self.strategy)
        module = model.module if self.strategy == "mfsdp" else model
        export_final_model(module, full_state_dict, self.directory, self.image_processor)
        self.best = {"step": step, **metrics}
        if not dist.is_initialized() or dist.get_rank() == 0:
            (self.directory / "validation.json").write_text(json.dumps(self.best, indent=2) + "\n")
            logger.info("New best validation accuracy %.2f%% at step %d: exported %s", 100 * metrics["accuracy"], step,
                        self.directory)  # fmt: skip
        return True
