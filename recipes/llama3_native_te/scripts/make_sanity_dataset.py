"""Write the recipe's tiny synthetic DNA datasets (deterministic; about 140 KB in all).

- ``data/sanity_dna.fasta``: 64 sequences of 2,000 bases from one order-2 Markov chain in which each 2-base
  context picks one preferred next base with probability 0.85 (the others 0.05 each). Its entropy rate is
  -(0.85 ln 0.85 + 3 * 0.05 ln 0.05) ~ 0.59 nats per base, far below ln 4 ~ 1.39 for independent bases: a model
  below ~1.2 nats is using context. About 5% of the bases sit in lowercase (soft-masked) stretches and some
  sequences hold runs of N, which the collator keeps out of the loss.
- ``data/overfit_dna.jsonl``: 4 random sequences of 120 bases (no context to learn; only memorising them brings
  the loss to ~0), for the L0_convergence config.

    python scripts/make_sanity_dataset.py
"""

import json
from pathlib import Path

import numpy as np


DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BASES = np.array(list("ACGT"))


def markov_sequences(rng: np.random.Generator, count: int, length: int, order: int = 2) -> list[str]:
    preferred = rng.integers(0, 4, size=4**order)
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


def main() -> None:
    rng = np.random.default_rng(1234)
    DATA_DIR.mkdir(exist_ok=True)
    with open(DATA_DIR / "sanity_dna.fasta", "w") as fh:
        for index, seq in enumerate(markov_sequences(rng, 64, 2000)):
            fh.write(f">synthetic_{index}\n")
            fh.writelines(seq[i : i + 80] + "\n" for i in range(0, len(seq), 80))
    with open(DATA_DIR / "overfit_dna.jsonl", "w") as fh:
        for index in range(4):
            fh.write(json.dumps({"id": f"random_{index}", "sequence": "".join(rng.choice(BASES, 120))}) + "\n")


if __name__ == "__main__":
    main()
