#!/usr/bin/env python3
"""What a masked-codon loss must beat to show that a model reads context: the baselines of a held-out split.

For the same files, codon policy, truncation and seeded train/validation split that ``train.py`` uses, print (nats):

* ``unigram_entropy``: the entropy of the codon frequencies of all the sequences (the figure data cards quote);
* ``unigram_cross_entropy``: codon frequencies counted on the training split, scored on the validation codons;
* ``context_free_bayes``: the best masked-codon loss of any model that sees only the position itself, never its
  neighbours, under the recipe's masking (of the selected codons 80% become <MASK>, 10% a random codon, 10% stay):
  it may read the input codon of the 20% that are not <MASK>, which makes it a little better than the cross-entropy.

A validation loss clearly below ``context_free_bayes`` can only come from the neighbouring codons.

    python scripts/codon_baselines.py --data /data/codon_orfs_train.parquet --val-fraction 0.1 --seed 42
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe's modules, from any working directory

from dataset import read_sequences, split_rows
from sequences import FIRST_CODON_ID, VOCAB_SIZE


MASK_SHARE, RANDOM_SHARE, KEEP_SHARE = 0.8, 0.1, 0.1  # of the selected codons (collator.MLMMasker)
N_CODONS = VOCAB_SIZE - FIRST_CODON_ID


def codon_counts(data, rows) -> np.ndarray:
    counts = np.zeros(N_CODONS)
    for row in rows:
        ids = data.tokens(row)
        ids = ids[(ids >= FIRST_CODON_ID)] - FIRST_CODON_ID  # codons only: no <CLS>, <SEP>, <UNK>
        counts += np.bincount(ids, minlength=N_CODONS)
    return counts


def entropy(p: np.ndarray, q: np.ndarray) -> float:
    """Cross-entropy of distribution q under data distribution p (nats); p = q gives the entropy."""
    keep = p > 0
    return float(-(p[keep] * np.log(q[keep])).sum())


def context_free_bayes(p_val: np.ndarray, q: np.ndarray) -> float:
    """Expected loss of the Bayes predictor that knows the codon frequencies ``q`` and sees the input codon."""
    loss = MASK_SHARE * entropy(p_val, q)
    # Input codon c: true codon x with probability q(x) * (RANDOM_SHARE / N + KEEP_SHARE * [x == c]).
    likelihood = RANDOM_SHARE / N_CODONS + KEEP_SHARE * np.eye(N_CODONS)  # [x, c]
    joint = q[:, None] * likelihood
    posterior = joint / joint.sum(axis=0, keepdims=True)  # q(x | c)
    data_joint = p_val[:, None] * likelihood  # how often the validation data shows (x, c)
    keep = data_joint > 0
    return loss + float(-(data_joint[keep] * np.log(posterior[keep])).sum())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the training file(s): data.train_path")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="data.val_fraction")
    parser.add_argument("--seed", type=int, default=42, help="data.seed (the run's seed)")
    parser.add_argument("--max-codons", type=int, default=2046, help="data.max_codons")
    parser.add_argument("--invalid-codon-policy", default="error", help="data.invalid_codon_policy")
    args = parser.parse_args(argv)
    data = read_sequences(args.data, invalid_codon_policy=args.invalid_codon_policy, max_codons=args.max_codons)
    train_rows, val_rows = split_rows(len(data), args.val_fraction, args.seed)
    all_counts = codon_counts(data, np.arange(len(data)))
    train_counts, val_counts = codon_counts(data, train_rows), codon_counts(data, val_rows)
    q = (train_counts + 1) / (train_counts + 1).sum()  # add-one: a codon unseen in training is still possible
    p_val = val_counts / val_counts.sum()
    result = {
        "sequences": {"train": len(train_rows), "val": len(val_rows)},
        "codons": {"train": int(train_counts.sum()), "val": int(val_counts.sum())},
        "unigram_entropy": entropy(all_counts / all_counts.sum(), all_counts / all_counts.sum()),
        "unigram_cross_entropy": entropy(p_val, q),
        "context_free_bayes": context_free_bayes(p_val, q),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
