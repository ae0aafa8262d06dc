"""What predict.py computes per sequence, and how it is written (a Lightning ``BasePredictionWriter``).

- **Embedding**: the mean of the last hidden states over the sequence's tokens (``<CLS>`` and ``<SEP>`` included,
  padding not): what the fine-tuning head pools (``modeling_codonfm_te.sequence_means``), in float32.
- **Pseudo-log-likelihood** (PLL): mask each codon in turn and sum ``log p(true codon | the rest)`` over the codons;
  also given per codon (``mean_log_likelihood`` = PLL / codons). A sequence of L codons costs L forward passes over
  L + 2 tokens; the masked copies of a batch's sequences are packed (THD) into forward passes of at most
  ``pll_token_budget`` tokens, and the MLM head runs only on the masked position of each copy.
- **Codons** are the real codons only: an ``<UNK>`` (an invalid or partial codon kept by
  ``invalid_codon_policy=unk``) stays in every copy as context but is neither masked nor scored, and ``num_codons``
  does not count it. Training never predicts ``<UNK>`` (the masker leaves special tokens out), so its probability
  means nothing. A sequence without a real codon gets PLL 0 and ``mean_log_likelihood`` NaN.

:class:`PredictionWriter` writes each rank's rows as they come (``predictions.rank<r>.parquet``); at the end rank 0
merges them, in input order, into ``predictions.parquet`` (``index``, ``id``, ``num_codons``, ``pll``,
``mean_log_likelihood``) and ``embeddings.npy`` (float32 [sequences, hidden], row i = ``index`` i).
"""

import logging
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from modeling_codonfm_te import NVEncodonForMaskedLM, sequence_means
from packing import IGNORE_INDEX
from sequences import MASK_ID, UNK_ID


logger = logging.getLogger(__name__)


class EncodonPredictModule(L.LightningModule):
    """Embeddings and PLLs of a trained ``NVEncodonForMaskedLM`` (no training, no gradients)."""

    def __init__(self, model: NVEncodonForMaskedLM, pll: bool = True, pll_token_budget: int = 16384):
        super().__init__()
        self.model = model.eval()
        self.pll, self.pll_token_budget = pll, int(pll_token_budget)

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        packed = self.model.encodon.pack(input_ids, attention_mask)
        hidden, _ = self.model.encodon.forward_packed(packed)
        lengths = attention_mask.sum(dim=1)
        unknown = ((input_ids == UNK_ID) & attention_mask.bool()).sum(dim=1)
        result = {
            "index": batch["sample_index"].cpu(),
            "id": list(batch["names"]),
            "num_codons": (lengths - 2 - unknown).cpu(),  # <CLS>, <SEP> and <UNK> are not codons
            "embedding": sequence_means(hidden, packed).float().cpu(),
        }
        if self.pll:
            result["pll"] = self.pseudo_log_likelihoods(input_ids, lengths).cpu()
        return result

    def pseudo_log_likelihoods(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B] float64: for each row, the sum over its codons of log p(codon | every other token), that codon masked.
        ``<UNK>`` positions are context only: never masked, never scored (module docstring)."""
        copies = []  # (row, one masked copy of the row's tokens, the masked position)
        for row, length in enumerate(lengths.tolist()):
            tokens = input_ids[row, :length]
            known = (tokens[1 : length - 1] != UNK_ID).nonzero().squeeze(1) + 1  # the codons, between <CLS> and <SEP>
            copies.extend((row, tokens, position) for position in known.tolist())
        totals = torch.zeros(len(lengths), dtype=torch.float64, device=input_ids.device)
        start = 0
        while start < len(copies):
            end, budget = start, 0
            while end < len(copies) and (end == start or budget + len(copies[end][1]) <= self.pll_token_budget):
                budget += len(copies[end][1])
                end += 1
            rows, log_probs = self._score(copies[start:end])
            totals.index_add_(0, rows, log_probs)
            start = end
        return totals

    def _score(self, copies: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed forward over masked copies: each copy's log-probability of its true codon."""
        device = copies[0][1].device
        pieces, labels, lengths = [], [], []
        for _, tokens, position in copies:
            masked, label = tokens.clone(), torch.full_like(tokens, IGNORE_INDEX)
            label[position], masked[position] = tokens[position], MASK_ID
            pieces.append(masked)
            labels.append(label)
            lengths.append(len(tokens))
        cu_seq_lens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu_seq_lens[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
        targets = torch.cat(labels)
        output = self.model(
            input_ids=torch.cat(pieces).unsqueeze(0),
            labels=targets.unsqueeze(0),
            cu_seq_lens_q=cu_seq_lens,
            cu_seq_lens_k=cu_seq_lens,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
            labeled_logits_only=True,  # logits only at the masked positions, one row per copy, in packed order
        )
        log_probs = torch.log_softmax(output.logits.double(), dim=-1)
        truth = targets[targets != IGNORE_INDEX]
        rows = torch.tensor([row for row, _, _ in copies], device=device)
        return rows, log_probs.gather(1, truth.unsqueeze(1)).squeeze(1)


class PredictionWriter(BasePredictionWriter):
    """Writes every batch's rows to this rank's Parquet part; rank 0 merges the parts at the end (module docstring)."""

    def __init__(self, output_dir: str | Path):
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self._writer: pq.ParquetWriter | None = None

    def _part(self, rank: int) -> Path:
        return self.output_dir / f"predictions.rank{rank}.parquet"

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        columns = {
            "index": pa.array(prediction["index"].numpy()),
            "id": pa.array(prediction["id"], pa.string()),
            "num_codons": pa.array(prediction["num_codons"].numpy()),
        }
        if "pll" in prediction:
            pll = prediction["pll"].numpy()
            columns["pll"] = pa.array(pll)
            codons = prediction["num_codons"].numpy()
            columns["mean_log_likelihood"] = pa.array(np.where(codons > 0, pll / np.maximum(codons, 1), np.nan))
        embedding = prediction["embedding"].numpy()
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(embedding.reshape(-1)), embedding.shape[1])
        table = pa.table(columns)
        if self._writer is None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._part(trainer.global_rank), table.schema)
        self._writer.write_table(table)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        trainer.strategy.barrier("predictions written")
        if trainer.is_global_zero:
            self.merge(trainer.world_size)

    def merge(self, world_size: int) -> None:
        parts = [self._part(rank) for rank in range(world_size) if self._part(rank).is_file()]
        table = pa.concat_tables([pq.read_table(part) for part in parts]).sort_by("index")
        embeddings = np.stack(table.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32)
        np.save(self.output_dir / "embeddings.npy", embeddings)
        pq.write_table(table.drop(["embedding"]), self.output_dir / "predictions.parquet")
        for part in parts:
            part.unlink()
        logger.info("Wrote %d sequences to %s (predictions.parquet, embeddings.npy)", len(table), self.output_dir)
