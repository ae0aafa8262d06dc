"""One rank of a Lightning DDP run (CPU, gloo) that records which sequences it trains and validates on.

    torchrun --nproc_per_node=2 tests/scripts/ddp_data_worker.py CORPUS OUT_DIR INPUT_FORMAT

Writes OUT_DIR/rank<r>.json: the token tuples of this rank's training batches (masked positions restored from the
labels), its batches per data epoch, and its validation sequences. tests/test_datamodule.py checks them.
"""

import json
import sys
from pathlib import Path

import lightning
import torch
from datamodule import CodonDataModule


def originals(batch) -> list[list[int]]:
    restored = torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])
    if "cu_seq_lens_q" in batch:
        bounds = batch["cu_seq_lens_q"].tolist()
        return [restored[0, a:b].tolist() for a, b in zip(bounds, bounds[1:])]
    return [row[mask.bool()].tolist() for row, mask in zip(restored, batch["attention_mask"])]


class Recorder(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.train_sequences, self.val_sequences = [], []

    def training_step(self, batch, batch_idx):
        self.train_sequences.append(originals(batch))
        return self.weight * batch["input_ids"].float().mean()

    def validation_step(self, batch, batch_idx):
        self.val_sequences += originals(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    corpus, out_dir, input_format = sys.argv[1:4]
    data = CodonDataModule({"train_path": corpus, "val_fraction": 0.25, "input_format": input_format,
                            "micro_batch_size": 4, "token_budget": 128, "max_codons": 40, "num_workers": 0})  # fmt: skip
    module = Recorder()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=14, val_check_interval=14,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, use_distributed_sampler=False, logger=False,
        enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out_dir,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "batches_per_epoch": data.batches_per_epoch(),
        "train": module.train_sequences,
        "val": module.val_sequences,
    }
    (Path(out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
