"""Masked-LM masking and batch collation, shared by every masked-LM recipe (ESM-2 and AMPLIFY on protein
sequences, Geneformer on rank-value encoded cells): mask, then pad (BSHD) or pack (THD), padded for CP.

A *sample* (what ``dataset.py`` yields) is a dict ``{"input_ids": 1-D int array of token ids (with the start and
end tokens where the model has them), "epoch": int, "sample_index": int}``. The collators turn a list of samples into
the batch contract the model's forward accepts:

- BSHD: ``input_ids``/``attention_mask``/``labels`` ``[B, S]`` int64, right-padded with ``<pad>``; labels are -100
  where there is no loss.
- THD: ``input_ids``/``labels`` ``[1, T]`` int64, ``cu_seq_lens_q``/``cu_seq_lens_k`` int32 ``[n + 1]`` and
  ``max_length_q``/``max_length_k`` python ints. With ``pad_to_multiple_of`` the total is padded by one extra
  pseudo-sequence of ``<pad>`` (labels -100) that is its own segment, so it attends only to itself.
- Padding for context parallelism (``cp_size > 1``): every sequence is padded to a multiple of ``2 * cp_size``, so
  that ``context_parallel.shard_for_context_parallel`` can cut it into ``2 * cp_size`` equal chunks in the training
  loop (CP rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``). The collators yield these *full* CP-ready
  batches; all CP ranks of a data-parallel group build the same ones. THD batches then carry the *global padded*
  cu_seqlens as ``cu_seq_lens_{q,k}`` and ``cu_seq_lens_{q,k}_padded``: real tokens of a sequence also see its few
  (< 2 * cp_size) pad tokens (labels -100). Declaring the padding as skipped instead (real boundaries in
  ``cu_seq_lens_q``) makes TE's ring attention leave those output rows unwritten, and the garbage there turns
  weight gradients into NaN.

Masking is a pure function of ``(seed, epoch, sample_index)``, so a resumed run needs no collator state, every CP
rank of a data-parallel group builds the identical full batch, and a sample gets the same mask whatever batch it
lands in (micro-batches of b and of 2 b hold the same masked samples).

Batches with nothing to predict: a batch whose samples drew no masked token would make a mean-reduced loss 0/0 =
NaN. The collators therefore force one masked token (chosen by the first sample's own RNG) into such a batch. A
CP *shard* can still hold no label; the training loop must reduce the loss as ``sum / max(count, 1)`` across the
CP group (or all-reduce the label count) rather than take a per-rank mean.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch


IGNORE_INDEX = -100


class MLMMasker:
    """BERT-style masking: select ``mlm_probability`` of the tokens; of those 80% -> <mask>, 10% -> a random token id
    from ``random_token_ids`` (half-open range), 10% unchanged. Special tokens (<cls>/<bos>, <eos>, <pad>, <unk>,
    <mask>) are never selected.

    ``random_token_ids`` is the vocabulary's range of real tokens, never a special one: each vocabulary says its own
    (the protein tokenizers' one-letter residues, ``protein/dataset.residue_token_ids``: ESM-2 4..28, AMPLIFY 6..26;
    Geneformer: every gene id; CodonFM: every codon id). There is no default, because one vocabulary's range holds
    another's special tokens or ids it does not have."""

    def __init__(
        self,
        mask_token_id: int,
        special_token_ids,
        seed: int,
        mlm_probability: float = 0.15,
        *,
        random_token_ids: tuple[int, int],
    ):
        if not 0.0 <= mlm_probability <= 1.0:
            raise ValueError(f"mlm_probability must be in [0, 1], got {mlm_probability}")
        self.mask_token_id = int(mask_token_id)
        self.special_token_ids = np.array(sorted({int(i) for i in special_token_ids}), dtype=np.int64)
        self.seed = int(seed)
        self.mlm_probability = float(mlm_probability)
        low, high = (int(i) for i in random_token_ids)
        if not 0 <= low < high or ((self.special_token_ids >= low) & (self.special_token_ids < high)).any():
            raise ValueError(
                f"random_token_ids {tuple(random_token_ids)} must be a non-empty id range without special tokens "
                f"(special ids: {self.special_token_ids.tolist()})"
            )
        self.random_token_ids = (low, high)

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer,
        seed: int,
        mlm_probability: float = 0.15,
        *,
        random_token_ids: tuple[int, int],
    ) -> "MLMMasker":
        if random_token_ids[1] > len(tokenizer):
            raise ValueError(
                f"random_token_ids {tuple(random_token_ids)} reach past the {len(tokenizer)}-token vocabulary"
            )
        return cls(
            tokenizer.mask_token_id,
            tokenizer.all_special_ids,
            seed,
            mlm_probability,
            random_token_ids=random_token_ids,
        )

    def _rng(self, epoch: int, sample_index: int) -> np.random.Generator:
        # SeedSequence mixes the three integers, so neighbouring samples get unrelated streams.
        return np.random.default_rng([self.seed, int(epoch), int(sample_index)])

    def candidates(self, input_ids: np.ndarray) -> np.ndarray:
        return ~np.isin(input_ids, self.special_token_ids)

    def __call__(self, input_ids, epoch: int, sample_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(masked_input_ids, labels)`` for one sample, both int64 arrays of the input's length."""
        ids = np.asarray(input_ids, dtype=np.int64)
        rng = self._rng(epoch, sample_index)
        # Draw every stream for the full length, whatever is selected, so the draws stay aligned per position.
        selected = (rng.random(ids.size) < self.mlm_probability) & self.candidates(ids)
        action = rng.random(ids.size)
        random_ids = rng.integers(*self.random_token_ids, size=ids.size)
        labels = np.where(selected, ids, IGNORE_INDEX)
        masked = ids.copy()
        masked[selected & (action < 0.8)] = self.mask_token_id
        replace = selected & (action >= 0.8) & (action < 0.9)
        masked[replace] = random_ids[replace]
        return masked, labels

    def force_one(self, input_ids, masked: np.ndarray, labels: np.ndarray, epoch: int, sample_index: int) -> bool:
        """Mask one residue of this sample in place (with <mask>); False if it has no residue to mask."""
        ids = np.asarray(input_ids, dtype=np.int64)
        positions = np.flatnonzero(self.candidates(ids))
        if positions.size == 0:
            return False
        # A separate stream (extra entropy word) keeps this draw independent of the regular masking draws.
        pos = positions[np.random.default_rng([self.seed, int(epoch), int(sample_index), 1]).integers(positions.size)]
        labels[pos] = ids[pos]
        masked[pos] = self.mask_token_id
        return True


def mask_samples(masker: MLMMasker, samples) -> list[tuple[np.ndarray, np.ndarray]]:
    """Mask every sample; if the whole batch drew no masked token, force one (see the module docstring)."""
    out = [masker(s["input_ids"], s["epoch"], s["sample_index"]) for s in samples]
    if masker.mlm_probability > 0 and not any((labels != IGNORE_INDEX).any() for _, labels in out):
        for sample, (masked, labels) in zip(samples, out):
            if masker.force_one(sample["input_ids"], masked, labels, sample["epoch"], sample["sample_index"]):
                break
    return out


def round_up(n, multiple: int):
    """Smallest multiple of ``multiple`` >= ``n`` (ints or integer numpy arrays)."""
    return -(-n // multiple) * multiple


def length_multiple(pad_to_multiple_of: int | None, cp_size: int) -> int:
    """What a padded length (BSHD: S, THD: T) must be a multiple of, so that each CP shard is itself a multiple of
    ``pad_to_multiple_of`` (FP8 GEMMs need 16) and every sequence splits into ``2 * cp_size`` equal chunks."""
    base = pad_to_multiple_of or 1
    if cp_size == 1:
        return base
    return math.lcm(2 * cp_size, base * cp_size)


@dataclass
class BSHDCollator:
    """Pad a list of samples to the longest (rounded up to ``length_multiple``) and mask them."""

    masker: MLMMasker
    pad_token_id: int
    pad_to_multiple_of: int | None = None
    cp_size: int = 1

    def __call__(self, samples) -> dict:
        masked = mask_samples(self.masker, samples)
        seq_len = round_up(max(ids.size for ids, _ in masked), length_multiple(self.pad_to_multiple_of, self.cp_size))
        input_ids = torch.full((len(samples), seq_len), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((len(samples), seq_len), IGNORE_INDEX, dtype=torch.int64)
        attention_mask = torch.zeros((len(samples), seq_len), dtype=torch.int64)
        for row, (ids, lab) in enumerate(masked):
            input_ids[row, : ids.size] = torch.from_numpy(ids)
            labels[row, : ids.size] = torch.from_numpy(lab)
            attention_mask[row, : ids.size] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclass
class THDCollator:
    """Pack a list of samples into one ``[1, T]`` row with cu_seqlens (see the module docstring) and mask them."""

    masker: MLMMasker
    pad_token_id: int
    pad_to_multiple_of: int | None = None
    cp_size: int = 1

    def __call__(self, samples) -> dict:
        masked = mask_samples(self.masker, samples)
        segment_multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        segments = [round_up(ids.size, segment_multiple) for ids, _ in masked]
        total = sum(segments)
        pseudo = round_up(total, length_multiple(self.pad_to_multiple_of, self.cp_size)) - total
        if pseudo:
            segments.append(pseudo)

        input_ids = torch.full((1, total + pseudo), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((1, total + pseudo), IGNORE_INDEX, dtype=torch.int64)
        cu_seq_lens = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_seq_lens[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
        for start, (ids, lab) in zip(cu_seq_lens.tolist(), masked):
            input_ids[0, start : start + ids.size] = torch.from_numpy(ids)
            labels[0, start : start + ids.size] = torch.from_numpy(lab)

        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens.clone(),
            "max_length_q": max(segments),
            "max_length_k": max(segments),
        }
        if self.cp_size > 1:
            # TE's ring attention leaves the outputs of skipped padding rows unwritten (garbage that turns gradients
            # into NaN), so CP padding counts as part of its sequence: real == padded boundaries.
            batch["cu_seq_lens_q_padded"] = cu_seq_lens.clone()
            batch["cu_seq_lens_k_padded"] = cu_seq_lens.clone()
        return batch
