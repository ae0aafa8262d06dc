"""What predict.py computes for each protein sequence.

- **Embedding**: the mean of the encoder's last hidden states (after its final norm) over the sequence's residues, the
  start and end tokens left out, in float32: the usual per-protein ESM-2 embedding.
- **Pseudo-log-likelihood** (PLL): mask each residue in turn and sum ``log p(true residue | every other token)`` over
  the residues; ``mean_log_likelihood`` = PLL / residues. A sequence of L residues costs L forward passes over L + 2
  tokens; the masked copies are packed (THD) into passes of at most ``pll_token_budget`` tokens, and the masked-LM head
  runs only on the masked position of each copy.

The sequences themselves are packed (THD) into passes of at most ``token_budget`` tokens, in input order; a sequence
longer than the budget gets a pass of its own. Each rank takes a contiguous share of the rows;
prediction_files.py joins the ranks' results, in input order, into ``predictions.parquet`` and ``embeddings.npy``.
"""

import numpy as np
import torch
import torch.nn.functional as F
from prediction_files import packed_passes
from tqdm import tqdm


class Predictor:
    """Embeddings and PLLs of a masked-LM model of this recipe (``NVEsmForMaskedLM`` or ``NVAmplifyForMaskedLM``).

    ``encoder`` is the model's encoder (``ModelFamily.encoder``): it packs token runs and returns their hidden states;
    ``model.head`` turns hidden states into vocabulary logits.
    """

    def __init__(
        self, model, encoder, mask_token_id: int, device: torch.device, token_budget: int, pll_token_budget: int
    ):
        self.model, self.encoder, self.mask_token_id, self.device = model, encoder, int(mask_token_id), device
        self.token_budget, self.pll_token_budget = int(token_budget), int(pll_token_budget)

    def _hidden(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed forward over ``input_ids`` (CPU, the pieces end to end) cut into pieces of ``lengths``:
        ([tokens, hidden] last hidden states, [pieces + 1] int64 boundaries), both on the device."""
        boundaries = F.pad(lengths.cumsum(0), (1, 0)).to(self.device)
        cu_seqlens = boundaries.to(torch.int32)
        packed = self.encoder.pack(input_ids.to(self.device)[None], None, cu_seqlens, cu_seqlens, int(lengths.max()))
        hidden, _ = self.encoder.forward_packed(packed)
        return hidden, boundaries

    @torch.no_grad()
    def embeddings(self, token_lists: list[list[int]], progress: bool = False) -> np.ndarray:
        """[sequences, hidden] float32: each sequence's mean hidden state over its residues."""
        rows = []
        bar = tqdm(total=len(token_lists), desc="embeddings", unit="seq", disable=not progress)
        for run in packed_passes([len(tokens) for tokens in token_lists], self.token_budget):
            pieces = [torch.tensor(token_lists[i]) for i in run]
            hidden, boundaries = self._hidden(torch.cat(pieces), torch.tensor([len(piece) for piece in pieces]))
            lengths = boundaries[1:] - boundaries[:-1]
            sequence = torch.repeat_interleave(torch.arange(len(run), device=self.device), lengths)
            residue = torch.ones(hidden.shape[0], dtype=torch.bool, device=self.device)
            residue[boundaries[:-1]] = False  # the start token
            residue[boundaries[1:] - 1] = False  # the end token
            sums = torch.zeros(len(run), hidden.shape[1], dtype=torch.float32, device=self.device)
            sums.index_add_(0, sequence[residue], hidden[residue].float())
            rows.append((sums / (lengths - 2).unsqueeze(1)).cpu())
            bar.update(len(run))
        bar.close()
        return torch.cat(rows).numpy() if rows else np.zeros((0, 0), dtype=np.float32)

    @torch.no_grad()
    def pseudo_log_likelihoods(self, token_lists: list[list[int]], progress: bool = False) -> np.ndarray:
        """[sequences] float64: for each sequence the sum over its residues of log p(residue | the rest)."""
        sequences = [torch.tensor(tokens) for tokens in token_lists]
        # One masked copy per residue (between the start and end tokens): (sequence, masked position).
        copies = [(row, position) for row, tokens in enumerate(token_lists) for position in range(1, len(tokens) - 1)]
        totals = torch.zeros(len(token_lists), dtype=torch.float64, device=self.device)
        bar = tqdm(total=len(copies), desc="pseudo-log-likelihoods", unit="residue", disable=not progress)
        for run in packed_passes([len(token_lists[row]) for row, _ in copies], self.pll_token_budget):
            self._score([copies[i] for i in run], sequences, totals)
            bar.update(len(run))
        bar.close()
        return totals.cpu().numpy()

    def _score(self, copies: list[tuple[int, int]], sequences: list[torch.Tensor], totals: torch.Tensor) -> None:
        """One packed forward over masked copies: adds each copy's log-probability of its true residue to its row."""
        rows = torch.tensor([row for row, _ in copies])
        lengths = torch.tensor([len(sequences[row]) for row, _ in copies])
        input_ids = torch.cat([sequences[row] for row, _ in copies])
        masked = F.pad(lengths.cumsum(0), (1, 0))[:-1] + torch.tensor([position for _, position in copies])
        true = input_ids[masked]
        input_ids[masked] = self.mask_token_id
        hidden, _ = self._hidden(input_ids, lengths)
        masked, true = masked.to(self.device), true.to(self.device)
        log_probs = torch.log_softmax(self.model.head(hidden[masked]).float(), dim=-1)
        totals.index_add_(0, rows.to(self.device), log_probs.gather(1, true[:, None]).squeeze(1).double())
