"""Write the recipe's tiny synthetic DNA datasets (deterministic; about 165 KB in all).

- ``data/sanity_dna.fasta``: 64 sequences of 2,000 bases from one order-2 Markov chain in which each 2-base
  context takes its preferred next base with probability 0.85 and otherwise a uniformly drawn one, so the preferred
  base has probability 0.8875 and the others 0.0375 each. Its entropy rate is
  -(0.8875 ln 0.8875 + 3 * 0.0375 ln 0.0375) ~ 0.475 nats per base, far below ln 4 ~ 1.39 for independent bases: a
  model below ~1.2 nats is using context. About 5% of the bases sit in lowercase (soft-masked) stretches and some
  sequences hold runs of N, which the collator keeps out of the loss.
- ``data/sanity_dna_valid.fasta``: 16 held-out sequences of 2,000 bases from the same chain (the same preferred next
  bases), drawn with another seed, for ``validation.path`` in the L0 sanity configs: a model that learned the chain
  scores them as well as the training data, one that memorised the training data does not.
- ``data/overfit_dna.jsonl``: 4 random sequences of 120 bases (no context to learn; only memorising them brings
  the loss to ~0), for the L0_convergence config.

    python scripts/make_sanity_dataset.py
"""

import json
from pathlib import Path

import numpy as np


DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BASES = np.array(list("ACGT"))
ORDER = 2
TRAIN_SEED, VALID_SEED = 1234, 5678


def markov_chain(rng: np.random.Generator, order: int = ORDER) -> np.ndarray:
    """The chain: the preferred next base of each ``order``-base context."""
    return rng.integers(0, 4, size=4**order)


def markov_sequences(rng: np.random.Generator, preferred: np.ndarray, count: int, length: int) -> list[str]:
    order = round(np.log(len(preferred)) / np.log(4))
    sequences = []
    for _ in range(count):
        seq = list(rng.integers(0, 4, size=order))
        for _ in range(length - order):
            context = int(np.dot(seq[-order:], 4 ** np.arange(order)[::-1]))
            seq.append(preferred[context] if rng.random() < 0.85 else rng.integers(0, 4))
        text = list(BASES[seq])
        if rng.random() < 0.5:  # a soft-masked stretch
            start = int(rng.integers(0, length - 200))
            text[start : start + 200] = [b.lower() for b in text[start : start + 200]]
        if rng.random() < 0.3:  # a run of unknown bases
            start = int(rng.integers(0, length - 30))
            text[start : start + 30] = ["N"] * 30
        sequences.append("".join(text))
    return sequences


def write_fasta(path: Path, sequences: list[str], name: str) -> None:
    with open(path, "w") as fh:
        for index, seq in enumerate(sequences):
            fh.write(f">{name}_{index}\n")
            fh.writelines(seq[i : i + 80] + "\n" for i in range(0, len(seq), 80))


def main() -> None:
    rng = np.random.default_rng(TRAIN_SEED)  # draws the chain, then the training sequences, then overfit_dna.jsonl
    DATA_DIR.mkdir(exist_ok=True)
    preferred = markov_chain(rng)
    write_fasta(DATA_DIR / "sanity_dna.fasta", markov_sequences(rng, preferred, 64, 2000), "synthetic")
    with open(DATA_DIR / "overfit_dna.jsonl", "w") as fh:
        for index in range(4):
            fh.write(json.dumps({"id": f"random_{index}", "sequence": "".join(rng.choice(BASES, 120))}) + "\n")
    valid = markov_sequences(np.random.default_rng(VALID_SEED), preferred, 16, 2000)
    write_fasta(DATA_DIR / "sanity_dna_valid.fasta", valid, "synthetic_valid")


if __name__ == "__main__":
    main()
