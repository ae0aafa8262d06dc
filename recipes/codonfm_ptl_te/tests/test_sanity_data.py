"""The sanity data and its reference loss: forward-backward against brute-force enumeration, the masking model
against what the collator really does, and the shipped files against what the script generates."""

import csv
import itertools
import re
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import sanity_reference as ref
from datamodule import codon_masker
from dataset import RECIPE_DIR, read_sequences


sys.path.insert(0, str(RECIPE_DIR / "scripts"))
import make_sanity_dataset


DATA = RECIPE_DIR / "data"
MASK = "mask"


def p_visible(visible, true, n_states, selected, mlm_probability):
    """P(visible | true codon) from the masking rules: selected -> 80% <mask>, 10% a uniform codon, 10% kept;
    ``true`` may be an array of codons."""
    if isinstance(visible, str):  # <mask>: only a selected position shows it
        return (0.8 if selected else mlm_probability * 0.8) + 0 * np.asarray(true)
    kept = np.asarray(true) == visible
    given_selected = 0.1 / n_states + 0.1 * kept
    if selected:
        return given_selected
    return mlm_probability * given_selected + (1 - mlm_probability) * kept


def brute_force_posteriors(transition, initial, visible, mlm_probability):
    """P(x_t | visible, t selected) for every t, by summing over all hidden paths."""
    n_states, length = len(initial), len(visible)
    posteriors = np.zeros((length, n_states))
    for path in itertools.product(range(n_states), repeat=length):
        prior = initial[path[0]] * np.prod([transition[a, b] for a, b in zip(path, path[1:])])
        for t in range(length):
            likelihood = np.prod([p_visible(visible[s], path[s], n_states, s == t, mlm_probability)
                                  for s in range(length)])  # fmt: skip
            posteriors[t, path[t]] += prior * likelihood
    return posteriors / posteriors.sum(axis=1, keepdims=True)


def test_forward_backward_matches_brute_force_on_a_tiny_chain():
    rng = np.random.default_rng(0)
    n_states = 3
    transition = rng.dirichlet(np.ones(n_states), size=n_states)
    transition[0, 2] = 0.0  # a forbidden transition, as the sparse chain has
    transition /= transition.sum(axis=1, keepdims=True)
    initial = rng.dirichlet(np.ones(n_states))
    for visible in ([MASK, 1, 0, MASK, 2], [0, 0, MASK, MASK, 1], [2, MASK, 1, 1, 0]):
        observations = np.array([n_states if v == MASK else v for v in visible])
        fast = ref.masked_posteriors(transition, initial, observations, 0.3)
        slow = brute_force_posteriors(transition, initial, visible, 0.3)
        np.testing.assert_allclose(fast, slow, rtol=1e-10, atol=1e-12)


def test_optimal_loss_matches_brute_force_on_the_real_chain():
    """Three-codon sequences: enumerate all 64**3 paths of the shipped chain, with the collator's own masks."""
    transition, initial = ref.make_chain()
    masker = codon_masker(seed=7, mlm_probability=0.5)
    rng = np.random.default_rng(1)
    samples = []
    for index in range(12):
        states = ref.sample_codon_states(transition, initial, 3, rng)
        samples.append({"input_ids": np.array([0, *(states + 5), 1]), "epoch": 0, "sample_index": index})
    prior = initial[:, None, None] * transition[:, :, None] * transition[None, :, :]  # [x0, x1, x2]
    codes = np.arange(64)
    total, count = 0.0, 0
    for sample in samples:
        masked, labels = masker(sample["input_ids"], 0, sample["sample_index"])
        visible = [MASK if v == 4 else v - 5 for v in masked[1:4]]
        for t in np.flatnonzero(labels[1:4] != -100):
            joint = prior.copy()
            for s in range(3):
                shape = [1, 1, 1]
                shape[s] = 64
                joint = joint * p_visible(visible[s], codes, 64, s == t, 0.5).reshape(shape)
            marginal = joint.sum(axis=tuple(a for a in range(3) if a != t))
            total -= np.log(marginal[labels[1 + t] - 5] / marginal.sum())
            count += 1
    assert count >= 10
    assert ref.optimal_masked_loss(samples, transition, initial, masker) == pytest.approx(total / count, rel=1e-9)


def test_the_collator_masks_as_the_reference_assumes():
    """Empirical P(visible | true codon) of the recipe's masker against the emission tables of the reference."""
    rng = np.random.default_rng(2)
    masker = codon_masker(seed=3, mlm_probability=0.15)
    true, seen, chosen = [], [], []
    for index in range(3000):
        ids = np.concatenate([[0], rng.integers(5, 69, 60), [1]])
        masked, labels = masker(ids, 0, index)
        true.append(ids[1:-1] - 5)
        seen.append(ref.visible_states(masked[1:-1]))
        chosen.append(labels[1:-1] != -100)
    true, seen, chosen = map(np.concatenate, (true, seen, chosen))
    assert chosen.mean() == pytest.approx(0.15, abs=0.005)
    any_position, selected = ref.emissions(0.15)
    for name, rows, table in (("selected", chosen, selected), ("any", np.ones_like(chosen), any_position)):
        x, v = true[rows], seen[rows]
        frequencies = {"mask": (v == 64).mean(), "kept": (v == x).mean(), "other codon": ((v != x) & (v < 64)).mean()}
        expected = {"mask": table[64, 0], "kept": table[0, 0], "other codon": 63 * table[1, 0]}
        for key in frequencies:
            assert frequencies[key] == pytest.approx(expected[key], abs=0.006), (name, key)
    replaced = seen[chosen & (seen < 64) & (seen != true)]
    assert len(np.unique(replaced)) == 64  # random replacements are uniform over all 64 codons


def test_chain():
    transition, initial = ref.make_chain()
    np.testing.assert_allclose(transition.sum(axis=1), 1.0)
    assert ((transition > 0).sum(axis=1) == ref.N_SUCCESSORS).all()
    np.testing.assert_allclose(initial @ transition, initial, atol=1e-12)
    assert (initial > 0).all()


def test_shipped_files_are_what_the_script_generates():
    tables = make_sanity_dataset.make_tables()
    for name in ("sanity_train.parquet", "sanity_val.parquet"):
        assert pq.read_table(DATA / name).equals(tables[name]), name
    with open(DATA / "finetune_sanity.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    expected = tables["finetune_sanity.csv"]
    assert [r["sequence"] for r in rows] == expected.column("sequence").to_pylist()
    assert [float(r["label"]) for r in rows] == expected.column("label").to_pylist()
    total = sum(path.stat().st_size for path in DATA.iterdir() if path.suffix in (".parquet", ".csv"))
    assert total < 300_000


def test_finetune_label_is_gc3():
    data = read_sequences(DATA / "finetune_sanity.csv", label_column="label", task="regression")
    with open(DATA / "finetune_sanity.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            thirds = row["sequence"][2::3]
            assert float(row["label"]) == round(sum(b in "GC" for b in thirds) / len(thirds), 4)
    assert len(data) == 600 and data.labels.std() > 0.15  # spread enough to learn


def test_sanity_sets_are_valid_codon_sequences():
    for name, n in (("sanity_train.parquet", 3000), ("sanity_val.parquet", 300)):
        data = read_sequences(DATA / name)  # invalid_codon_policy=error: every sequence is whole codons
        codons = data.lengths - 2
        assert len(data) == n and codons.min() >= ref.MIN_CODONS and codons.max() <= ref.MAX_CODONS


def test_reference_numbers_and_readme():
    numbers = ref.reference_numbers(DATA / "sanity_val.parquet", seed=42)
    # The bracket the L0 test relies on: the optimum far below what frequencies alone give.
    assert numbers["optimal_masked_loss"] < 0.2 < 3.0 < numbers["unigram_entropy"]
    assert numbers["optimal_masked_loss"] < numbers["entropy_rate"] < numbers["unigram_entropy"] < numbers["uniform"]
    # The unigram entropy is the codon frequencies' entropy: compare with the training set's own counts.
    train = read_sequences(DATA / "sanity_train.parquet")
    counts = np.bincount(train.flat[train.flat >= 5] - 5, minlength=64)
    plug_in = -(counts / counts.sum() * np.log(counts / counts.sum())).sum()
    assert plug_in == pytest.approx(numbers["unigram_entropy"], abs=0.02)
    readme = (DATA / "README.md").read_text()
    for key in ("optimal_masked_loss", "unigram_entropy"):
        assert re.search(rf"{key}\D*{numbers[key]:.4f}", readme), key
