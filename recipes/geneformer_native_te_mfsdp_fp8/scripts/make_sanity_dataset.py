#!/usr/bin/env python3
"""Write data/sanity_cells.parquet: a small synthetic corpus of rank-value encoded cells that a tiny Geneformer learns
in about a minute on a CPU, and that a model which ignores the rest of the cell cannot; with ``--held-out``, its
held-out set data/sanity_cells_val.parquet.

What the data is. There are N_CELL_TYPES = 8 cell types. Each has a *program*: PROGRAM_LENGTH = 48 genes of its own
(no gene belongs to two types; ids drawn once from 2..1023, so never <pad> = 0 or <mask> = 1; the L0 model
has a 1,024-token vocabulary) in a fixed order, its
characteristic ranking. A cell (N_CELLS = 2,000) picks a type at random and expresses that program, perturbed as
real cells are:

- dropout: each gene of the program is missing with probability DROPOUT = 0.05 (not detected);
- local swaps: each gene's rank is jittered by Gaussian noise of RANK_JITTER = 1 rank before the genes are sorted
  again, so neighbours trade places now and then, genes far apart never;
- depth: the cell keeps only its first n genes, n uniform in [MIN_GENES, MAX_GENES] = [24, 48].

Columns: ``input_ids`` (list<int32>, highest-ranked gene first, as Geneformer's rank-value encoding) and ``length``
(int32). The generator is seeded, so running it again writes the same table (tests/test_dataset.py checks that).

The held-out set (``--held-out``, ``validation.path`` of the L0 sanity config): N_VAL_CELLS = 200 other cells of the
same 8 programs. One generator seeded with SEED draws the programs and then the training cells; the held-out cells
are drawn after the same programs by a fresh generator seeded with VAL_CELL_SEED (``make_cells(cell_seed=...)``), so
a model that learned the programs scores them as well as the training cells, and one that memorised cells does not.

What loss to expect. 15% of the genes are masked (80% <mask>, 10% a random gene, 10% left in place), so a masked
target is distributed like the corpus's genes. The script prints the entropy of that distribution, alone and given
what a model could know (nats, the unit of the training loss; plug-in estimates over the corpus):

    uniform over the vocabulary       ln(1024) = 6.93     a model at initialisation
    H(gene)                           5.87   the unigram entropy: the best loss without looking at the cell
    H(gene | cell type)               3.79   the type is named by any few unmasked genes (programs share none)
    H(gene | cell type, rank)         1.67   ... and the gene's position in the ranking
    H(gene | previous gene)           1.61   the neighbour above alone
    H(gene | previous and next gene)  1.05   both neighbours (when they are not masked themselves)

So a loss clearly below 5.87 is the proof that the model uses the rest of the cell (attention, positions, masking
and packing all working); a loss stuck near 5.87 means it does not. There are only 384 genes in all (8 x 48): each
is seen a few times per step, which is what lets a tiny model get there quickly. Measured with a stand-in 2-layer,
128-wide BERT (4 heads, FFN 256, AdamW lr 2e-3, 20 warm-up steps, ~1,000 tokens = ~28 cells per step): the loss
falls from ln(25426) = 10.1 (that stand-in's vocabulary) to the unigram entropy by step ~55, to 4.9 (1 nat below it) by step ~95 and to ~4.3 at step 150,
in under a minute on two CPU cores. With ~2,000 tokens per step (THD token_budget 2048), lr 3e-3 and 10 warm-up
steps it is 1 nat below by step ~55 and ~4.3 at step 80. Learning is per token seen: a BSHD micro-batch of 8 cells
(~290 tokens) needs several times more steps.

    python scripts/make_sanity_dataset.py            # writes data/sanity_cells.parquet beside this folder
    python scripts/make_sanity_dataset.py --held-out # writes data/sanity_cells_val.parquet
    python scripts/make_sanity_dataset.py --output /tmp/cells.parquet
"""

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


SEED = 20_241_124
# The L0 model's vocabulary (hydra_config/L0_sanity.yaml): <pad> = 0, <mask> = 1 and 1,022 genes. A small vocabulary
# keeps the MLM head, which dominates a 2-layer model's compute at Geneformer's 25,426 tokens, cheap on a CPU.
VOCAB_SIZE = 1_024
FIRST_GENE_ID = 2
N_CELLS = 2_000
N_CELL_TYPES = 8
PROGRAM_LENGTH = 48
MIN_GENES, MAX_GENES = 24, 48
DROPOUT = 0.05
RANK_JITTER = 1.0
OUTPUT = Path(__file__).resolve().parent.parent / "data" / "sanity_cells.parquet"
# The held-out set: other cells of the same programs.
N_VAL_CELLS = 200
VAL_CELL_SEED = 20_241_125
VAL_OUTPUT = OUTPUT.with_name("sanity_cells_val.parquet")


def make_cells(
    n_cells: int = N_CELLS, seed: int = SEED, cell_seed: int | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """``(cells, cell_types)``: each cell an int32 array of gene ids, highest-ranked first. The programs come from
    ``seed``; the cells from the same generator after them, or, with ``cell_seed``, from a fresh one seeded with it
    (other cells of the same programs: the held-out set)."""
    rng = np.random.default_rng(seed)
    genes = FIRST_GENE_ID + rng.choice(VOCAB_SIZE - FIRST_GENE_ID, N_CELL_TYPES * PROGRAM_LENGTH, replace=False)
    programs = genes.reshape(N_CELL_TYPES, PROGRAM_LENGTH).astype(np.int32)
    if cell_seed is not None:
        rng = np.random.default_rng(cell_seed)
    cell_types = rng.integers(N_CELL_TYPES, size=n_cells)
    cells = []
    for cell_type in cell_types:
        detected = rng.random(PROGRAM_LENGTH) >= DROPOUT
        score = np.arange(PROGRAM_LENGTH) + rng.normal(0.0, RANK_JITTER, PROGRAM_LENGTH)
        ranked = programs[cell_type][np.argsort(np.where(detected, score, np.inf), kind="stable")]
        n_genes = min(int(rng.integers(MIN_GENES, MAX_GENES + 1)), int(detected.sum()))
        cells.append(ranked[:n_genes])
    return cells, cell_types


def entropy(labels: np.ndarray, given: np.ndarray | None = None) -> float:
    """Plug-in entropy (nats) of ``labels``, or conditional entropy H(labels | given) for integer-coded ``given``."""
    if given is None:
        given = np.zeros_like(labels)
    _, pair_counts = np.unique(np.stack([given, labels]), axis=1, return_counts=True)
    _, given_counts = np.unique(given, return_counts=True)
    n = labels.size
    h_joint = -np.sum(pair_counts / n * np.log(pair_counts / n))
    h_given = -np.sum(given_counts / n * np.log(given_counts / n))
    return float(h_joint - h_given)


def target_entropies(cells: list[np.ndarray], cell_types: np.ndarray) -> dict[str, float]:
    """Entropies of a masked target (a uniformly drawn gene of the corpus), alone and given the type / the rank."""
    genes = np.concatenate(cells).astype(np.int64)
    types = np.repeat(cell_types, [len(c) for c in cells])
    ranks = np.concatenate([np.arange(len(c)) for c in cells])
    previous = np.concatenate([[-1, *c[:-1]] for c in cells])  # -1: the first gene has no previous one
    following = np.concatenate([[*c[1:], -1] for c in cells])  # -1: the last gene has no next one
    return {
        "H(gene)": entropy(genes),
        "H(gene | cell type)": entropy(genes, types),
        "H(gene | cell type, rank)": entropy(genes, types * MAX_GENES + ranks),
        "H(gene | previous gene)": entropy(genes, previous),
        "H(gene | previous and next gene)": entropy(genes, (previous + 1) * (VOCAB_SIZE + 1) + following + 1),
    }


def cell_table(cells: list[np.ndarray]) -> pa.Table:
    offsets = np.zeros(len(cells) + 1, dtype=np.int32)
    np.cumsum([len(c) for c in cells], out=offsets[1:])
    input_ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(cells), pa.int32()))
    return pa.table({"input_ids": input_ids, "length": pa.array(np.diff(offsets), pa.int32())})


def write(path: Path, n_cells: int = N_CELLS, seed: int = SEED, cell_seed: int | None = None) -> dict[str, float]:
    cells, cell_types = make_cells(n_cells, seed, cell_seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Plain int32 values (no dictionary) compressed with zstd: the repeated program stretches compress well.
    pq.write_table(cell_table(cells), path, compression="zstd", compression_level=19, use_dictionary=False)
    return target_entropies(cells, cell_types)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--held-out",
        action="store_true",
        help=f"write the held-out set: {N_VAL_CELLS} other cells of the same programs (cell seed {VAL_CELL_SEED}) "
        f"to {VAL_OUTPUT.name}, unless --output, --cells or --cell-seed say otherwise",
    )
    parser.add_argument("--output", type=Path, default=None, help=f"default: {OUTPUT.name} (or {VAL_OUTPUT.name})")
    parser.add_argument("--cells", type=int, default=None, help=f"default: {N_CELLS} (or {N_VAL_CELLS})")
    parser.add_argument(
        "--seed", type=int, default=SEED, help="seeds the programs (and the cells, without a cell seed)"
    )
    parser.add_argument("--cell-seed", type=int, default=None, help="draw the cells from a generator of their own")
    args = parser.parse_args()
    held_out_defaults = {"output": VAL_OUTPUT, "cells": N_VAL_CELLS, "cell_seed": VAL_CELL_SEED}
    defaults = held_out_defaults if args.held_out else {"output": OUTPUT, "cells": N_CELLS, "cell_seed": None}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    entropies = write(args.output, args.cells, args.seed, args.cell_seed)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1024:.0f} KiB, {args.cells} cells)")
    print(f"uniform over the vocabulary: ln({VOCAB_SIZE}) = {np.log(VOCAB_SIZE):.2f} nats")
    for name, value in entropies.items():
        print(f"{name}: {value:.2f} nats")


if __name__ == "__main__":
    main()
