#!/usr/bin/env python3
"""Write the recipe's small synthetic data sets (seeded; running it again writes the same tables):

- ``data/sanity_train.parquet`` (3,000 sequences) and ``data/sanity_val.parquet`` (300), columns ``id`` and
  ``sequence``: 30-120 codons each (uniform), sampled from the sparse codon Markov chain of ``sanity_reference.py``
  (each codon has 3 possible successors), for masked-codon pre-training. ``python sanity_reference.py`` prints the
  best loss a model can reach on the validation set and the unigram entropy (data/README.md has both).
- ``data/finetune_sanity.csv`` (600 rows), columns ``sequence`` and ``label``, for sequence-level regression. The
  label is GC3, the fraction of a sequence's codons whose third base is G or C (rounded to 4 decimals): a function of
  the codon counts that a pooled head learns. Each sequence has 30-60 codons; its first two bases per codon are
  uniform, its third is G/C with a propensity drawn per sequence from U(0.1, 0.9), so GC3 spreads over ~0.1-0.9.

    python scripts/make_sanity_dataset.py [--output-dir data]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


RECIPE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(RECIPE_DIR))

import sanity_reference as chain  # noqa: E402


SEED = 20_250_717
N_TRAIN, N_VAL = 3_000, 300
N_FINETUNE = 600
FINETUNE_CODONS = (30, 60)
GC3_PROPENSITY = (0.1, 0.9)


def markov_sequences(rng: np.random.Generator, n: int, prefix: str) -> pa.Table:
    transition, initial = chain.make_chain()
    lengths = rng.integers(chain.MIN_CODONS, chain.MAX_CODONS + 1, size=n)
    sequences = [chain.states_to_sequence(chain.sample_codon_states(transition, initial, int(n_codons), rng))
                 for n_codons in lengths]  # fmt: skip
    return pa.table({"id": [f"{prefix}_{i:05d}" for i in range(n)], "sequence": sequences})


def gc3(sequence: str) -> float:
    thirds = sequence[2::3]
    return sum(base in "GC" for base in thirds) / len(thirds)


def finetune_table(rng: np.random.Generator, n: int) -> pa.Table:
    sequences, labels = [], []
    for _ in range(n):
        n_codons = int(rng.integers(FINETUNE_CODONS[0], FINETUNE_CODONS[1] + 1))
        propensity = rng.uniform(*GC3_PROPENSITY)
        first_two = rng.choice(list("ACGT"), size=(n_codons, 2))
        third = np.where(rng.random(n_codons) < propensity, rng.choice(list("GC"), n_codons),
                         rng.choice(list("AT"), n_codons))  # fmt: skip
        sequence = "".join(a + b + c for (a, b), c in zip(first_two, third))
        sequences.append(sequence)
        labels.append(round(gc3(sequence), 4))
    return pa.table({"sequence": sequences, "label": labels})


def make_tables(seed: int = SEED) -> dict[str, pa.Table]:
    """The three tables, by file name."""
    rng = np.random.default_rng(seed)
    return {
        "sanity_train.parquet": markov_sequences(rng, N_TRAIN, "train"),
        "sanity_val.parquet": markov_sequences(rng, N_VAL, "val"),
        "finetune_sanity.csv": finetune_table(rng, N_FINETUNE),
    }


def write(tables: dict[str, pa.Table], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        if name.endswith(".parquet"):
            pq.write_table(table, output_dir / name, compression="zstd", compression_level=19)
        else:  # plain text, no quotes: the file is also for reading by eye
            rows = zip(*(table.column(c).to_pylist() for c in table.column_names))
            lines = [",".join(table.column_names)] + [",".join(str(value) for value in row) for row in rows]
            (output_dir / name).write_text("\n".join(lines) + "\n")
        print(f"wrote {output_dir / name} ({table.num_rows} rows, {(output_dir / name).stat().st_size:,} bytes)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=RECIPE_DIR / "data")
    args = parser.parse_args()
    write(make_tables(), args.output_dir)


if __name__ == "__main__":
    main()
