"""Write the recipe's tiny synthetic DNA data in OpenGenome2's layout (deterministic; about 60 KB in all).

One order-2 Markov chain generates every sequence: each 2-base context has a preferred next base, drawn with
probability 0.85, else a uniformly random base (which may be the preferred one again). So the preferred base has
probability 0.8875 and each other one 0.0375, an entropy rate of -(0.8875 ln 0.8875 + 3 * 0.0375 ln 0.0375) ~ 0.475
nats per base, far below ln 4 ~ 1.39 for independent bases: a loss below ~1.2 nats means the model uses context. Lengths vary from 200 to
3,000 bases, so the L0 windows (512 tokens) cut many sequences into several windows and leave others whole. About
half the sequences hold a soft-masked (lowercase) stretch and some hold runs of N, which the collator keeps out of the
loss.

- ``data/sanity_train_{0,1}.jsonl.gz``: two training shards of ``{"text": ..., "record": ...}`` lines;
- ``data/sanity_valid.jsonl.gz``: the held-out validation file (same chain, other sequences);
- ``data/sanity_eval.fasta``: a few sequences for ``scripts/evaluate_fasta_lm_loss.py``.

    python scripts/make_sanity_dataset.py
"""

import gzip
import json
from pathlib import Path

import numpy as np


DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BASES = np.array(list("ACGT"))


def markov_sequences(rng: np.random.Generator, preferred: np.ndarray, count: int) -> list[str]:
    sequences = []
    for _ in range(count):
        length = int(rng.integers(200, 3000))
        seq = list(rng.integers(0, 4, size=2))
        for _ in range(length - 2):
            context = 4 * seq[-2] + seq[-1]
            seq.append(preferred[context] if rng.random() < 0.85 else rng.integers(0, 4))
        text = list(BASES[seq])
        if rng.random() < 0.5:  # a soft-masked stretch
            start = int(rng.integers(0, length - 100))
            text[start : start + 100] = [b.lower() for b in text[start : start + 100]]
        if rng.random() < 0.3:  # a run of unknown bases
            start = int(rng.integers(0, length - 20))
            text[start : start + 20] = ["N"] * 20
        sequences.append("".join(text))
    return sequences


def write_jsonl_gz(path: Path, sequences: list[str], prefix: str) -> None:
    # mtime=0: the same bytes on every run, so regenerating the data leaves git clean.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        for index, seq in enumerate(sequences):
            fh.write((json.dumps({"text": seq, "record": f"{prefix}_{index}"}) + "\n").encode())


def main() -> None:
    rng = np.random.default_rng(2024)
    preferred = rng.integers(0, 4, size=16)
    DATA_DIR.mkdir(exist_ok=True)
    for shard in range(2):
        write_jsonl_gz(
            DATA_DIR / f"sanity_train_{shard}.jsonl.gz", markov_sequences(rng, preferred, 100), f"train{shard}"
        )
    write_jsonl_gz(DATA_DIR / "sanity_valid.jsonl.gz", markov_sequences(rng, preferred, 12), "valid")
    with open(DATA_DIR / "sanity_eval.fasta", "w") as fh:
        for index, seq in enumerate(markov_sequences(rng, preferred, 4)):
            fh.write(f">eval_{index} synthetic order-2 Markov chain\n")
            fh.writelines(seq[i : i + 80] + "\n" for i in range(0, len(seq), 80))


if __name__ == "__main__":
    main()
