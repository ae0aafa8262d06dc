"""Masking and collation of cells (collator.py, the shared masked-LM collator) with the gene vocabulary: BERT's
80/10/10 split, random replacements that are genes, and padded (BSHD) / packed (THD) batches checked by hand."""

import numpy as np
import pytest
import torch
from collator import IGNORE_INDEX, BSHDCollator, MLMMasker, THDCollator
from dataset import gene_token_ids


PAD, MASK = 0, 1
GENES = (2, 25_426)  # the half-open range of gene ids of the V1 vocabulary


def gene_masker(seed=0, p=0.15, random_token_ids=GENES):
    return MLMMasker(MASK, [PAD, MASK], seed=seed, mlm_probability=p, random_token_ids=random_token_ids)


def cell(genes, index, epoch=0):
    return {"input_ids": np.array(genes, dtype=np.int64), "epoch": epoch, "sample_index": index}


def test_from_tokenizer_takes_the_special_ids_and_the_gene_range(tokenizer):
    masker = MLMMasker.from_tokenizer(tokenizer, seed=0, random_token_ids=gene_token_ids(tokenizer))
    assert masker.mask_token_id == MASK and masker.special_token_ids.tolist() == [PAD, MASK]
    assert masker.random_token_ids == GENES
    # There is no default range: a protein range would hold <pad>, <mask> and gene ids alike.
    with pytest.raises(TypeError, match="random_token_ids"):
        MLMMasker.from_tokenizer(tokenizer, seed=0)


def test_bert_80_10_10_split_over_many_cells():
    masker = gene_masker(seed=1)
    rng = np.random.default_rng(0)
    n_genes = selected = to_mask = unchanged = randomised = 0
    for index in range(400):
        genes = rng.choice(np.arange(*GENES), size=500, replace=False)
        masked, labels = masker(genes, epoch=0, sample_index=index)
        sel = labels != IGNORE_INDEX
        assert (labels[sel] == genes[sel]).all() and (masked[~sel] == genes[~sel]).all()
        n_genes += genes.size
        selected += sel.sum()
        to_mask += (masked[sel] == MASK).sum()
        unchanged += (masked[sel] == genes[sel]).sum()
        replaced = sel & (masked != MASK) & (masked != genes)
        randomised += replaced.sum()
        assert ((masked[replaced] >= 2) & (masked[replaced] < 25_426)).all()
    # 400 x 500 genes: the standard error of 15% is 0.0008; of the 80/10/10 shares of ~30,000 targets, <= 0.0023.
    assert selected / n_genes == pytest.approx(0.15, abs=0.004)
    assert to_mask / selected == pytest.approx(0.80, abs=0.012)
    assert randomised / selected == pytest.approx(0.10, abs=0.01)  # a random gene equals the original 1 in 25,424
    assert unchanged / selected == pytest.approx(0.10, abs=0.01)


def test_random_replacements_are_never_pad_or_mask():
    """With only genes 2..4 to draw from, <pad> (0) and <mask> (1) would show up quickly if the range included them;
    the protein default (4, 29) would put non-genes into a 5-id vocabulary."""
    masker = gene_masker(p=1.0, random_token_ids=(2, 5))
    drawn = set()
    for index in range(300):
        genes = np.array([2, 3, 4, 3, 2, 4])
        masked, labels = masker(genes, epoch=0, sample_index=index)
        drawn.update(masked[(masked != MASK)].tolist())
        assert (labels == genes).all()  # p = 1: every gene is a target
    assert drawn == {2, 3, 4}


def test_special_tokens_are_never_selected():
    masker = gene_masker(p=0.9)
    ids = np.array([5, 6, MASK, 7, PAD, PAD])
    for index in range(200):
        masked, labels = masker(ids, epoch=0, sample_index=index)
        assert (labels[[2, 4, 5]] == IGNORE_INDEX).all() and (masked[[2, 4, 5]] == ids[[2, 4, 5]]).all()


def test_masking_depends_only_on_seed_epoch_and_sample_index():
    genes = list(np.random.default_rng(3).integers(2, 25_426, size=200))
    collate = BSHDCollator(gene_masker(seed=5), PAD)
    first = collate([cell(genes, 11), cell(genes, 12)])
    second = collate([cell(genes, 12), cell(genes[:50], 13)])
    assert torch.equal(first["labels"][1], second["labels"][0])  # cell 12 masked alike in another batch and slot
    assert torch.equal(first["input_ids"][1], second["input_ids"][0])
    assert not torch.equal(first["labels"][0], first["labels"][1])  # same genes, another cell: another mask
    assert not torch.equal(collate([cell(genes, 12, epoch=1)])["labels"][0], first["labels"][1])


def test_a_batch_without_a_target_gets_one():
    masker = gene_masker(p=1e-9)
    for collate in (BSHDCollator(masker, PAD), THDCollator(masker, PAD)):
        labels = collate([cell([5, 6, 7], 0), cell([8, 9], 1)])["labels"]
        assert (labels != IGNORE_INDEX).sum() == 1


def test_bshd_pads_cells_by_hand():
    cells = [cell([5, 6, 7], 0), cell([8], 1), cell([9, 10, 11, 12], 2)]
    batch = BSHDCollator(gene_masker(p=0.0), PAD)(cells)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert (batch["labels"] == IGNORE_INDEX).all()
    assert all(t.dtype == torch.int64 for t in batch.values())

    padded = BSHDCollator(gene_masker(p=0.5), PAD, pad_to_multiple_of=8)(cells)
    assert padded["input_ids"].shape == (3, 8)
    assert (padded["input_ids"][:, 4:] == PAD).all() and (padded["labels"][:, 4:] == IGNORE_INDEX).all()
    assert (padded["labels"][1, 1:] == IGNORE_INDEX).all()  # the padding of the one-gene cell


def test_thd_packs_cells_by_hand():
    cells = [cell([5, 6, 7], 0), cell([8], 1), cell([9, 10, 11, 12], 2)]
    batch = THDCollator(gene_masker(p=0.0), PAD)(cells)
    assert set(batch) == {"input_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]  # no <cls>/<eos>: Geneformer V1 has none
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 4, 8]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 4

    padded = THDCollator(gene_masker(p=0.5), PAD, pad_to_multiple_of=16)(cells)
    assert padded["cu_seq_lens_q"].tolist() == [0, 3, 4, 8, 16]  # an 8-token <pad> pseudo-cell
    assert padded["input_ids"][0, 8:].tolist() == [PAD] * 8
    assert (padded["labels"][0, 8:] == IGNORE_INDEX).all()
    assert padded["max_length_q"] == 8
