"""MLM masking, BSHD padding / THD packing, padding for context parallelism and the CP shards of these batches
(``context_parallel.shard_for_context_parallel``), checked against hand-computed expectations."""

from pathlib import Path

import numpy as np
import pytest
import torch
from collator import IGNORE_INDEX, BSHDCollator, MLMMasker, THDCollator
from context_parallel import shard_for_context_parallel, unshard_context_parallel
from dataset import residue_token_ids
from grad_accumulation import count_targets
from transformers import AutoTokenizer


CLS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 32


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "tokenizer")


RESIDUES = (4, 29)  # ESM-2's one-letter residues L..O, the random replacements


def make_masker(seed=0, p=0.15):
    return MLMMasker(MASK, [CLS, PAD, EOS, UNK, MASK], seed=seed, mlm_probability=p, random_token_ids=RESIDUES)


def sample(residues, index, epoch=0):
    return {"input_ids": np.array([CLS, *residues, EOS]), "epoch": epoch, "sample_index": index}


def original(input_ids, labels):
    """Undo the masking: a label holds the original token wherever one was set."""
    return torch.where(labels != IGNORE_INDEX, labels, input_ids)


def test_masker_uses_tokenizer_special_ids(tokenizer):
    masker = MLMMasker.from_tokenizer(tokenizer, seed=0, random_token_ids=residue_token_ids(tokenizer))
    assert masker.mask_token_id == MASK
    assert masker.special_token_ids.tolist() == [CLS, PAD, EOS, UNK, MASK]
    assert masker.random_token_ids == RESIDUES


def test_random_replacements_are_the_tokenizers_own_residues(tokenizer):
    """AMPLIFY's vocabulary puts <eos> and '|' at ids 4 and 5, its residues at 6..26 and has no id 27 or 28: ESM-2's
    range 4..28 would replace residues with those (and did, until 2026-12-05). Each tokenizer gives its own range."""
    amplify = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "tokenizer_amplify")
    assert residue_token_ids(amplify) == (6, 27)
    residues = {token for token in amplify.get_vocab() if len(token) == 1 and token.isalpha()}
    assert {amplify.convert_ids_to_tokens(i) for i in range(6, 27)} == residues
    masker = MLMMasker.from_tokenizer(
        amplify, seed=0, mlm_probability=1.0, random_token_ids=residue_token_ids(amplify)
    )
    sequence = np.array([amplify.bos_token_id, *amplify.convert_tokens_to_ids(list("MKTAYIAKQRQISFVKSHFSRQ")), 4])
    replaced = set()
    for index in range(300):
        masked, labels = masker(sequence, epoch=0, sample_index=index)
        replaced |= set(masked[(labels != IGNORE_INDEX) & (masked != amplify.mask_token_id)].tolist())
    assert replaced and replaced <= set(range(6, 27)), sorted(replaced)


def test_a_random_range_with_special_tokens_or_past_the_vocabulary_is_refused(tokenizer):
    with pytest.raises(ValueError, match="without special tokens"):
        MLMMasker(MASK, [CLS, PAD, EOS, UNK, MASK], seed=0, random_token_ids=(2, 29))
    with pytest.raises(ValueError, match="past the 33-token vocabulary"):
        MLMMasker.from_tokenizer(tokenizer, seed=0, random_token_ids=(4, 40))
    with pytest.raises(TypeError, match="random_token_ids"):  # no default: one vocabulary's range is not another's
        MLMMasker.from_tokenizer(tokenizer, seed=0)


def test_masking_statistics():
    masker = make_masker(seed=1)
    rng = np.random.default_rng(0)
    n_residues = selected = to_mask = unchanged = randomised = 0
    for index in range(400):
        ids = np.array([CLS, *rng.integers(4, 24, size=500), EOS])
        masked, labels = masker(ids, epoch=0, sample_index=index)
        sel = labels != IGNORE_INDEX
        assert (labels[sel] == ids[sel]).all()
        assert not sel[[0, -1]].any()
        n_residues += 500
        selected += sel.sum()
        to_mask += (masked[sel] == MASK).sum()
        unchanged += (masked[sel] == ids[sel]).sum()
        replaced = sel & (masked != MASK) & (masked != ids)
        randomised += replaced.sum()
        # Random replacements are real residues, never special tokens, '.', '-' or <null_1>.
        assert ((masked[replaced] >= 4) & (masked[replaced] <= 28)).all()
        assert (masked[~sel] == ids[~sel]).all()
    assert selected / n_residues == pytest.approx(0.15, abs=0.005)
    assert to_mask / selected == pytest.approx(0.80, abs=0.015)
    # 10% draw a random residue out of 25 (ids 4..28); 1 in 25 of those is the original residue again.
    assert randomised / selected == pytest.approx(0.10 * 24 / 25, abs=0.01)
    assert unchanged / selected == pytest.approx(0.10 + 0.10 / 25, abs=0.01)


def test_special_tokens_are_never_selected():
    masker = make_masker(p=0.9)
    ids = np.array([CLS, 5, UNK, 6, MASK, 7, EOS, PAD, PAD])
    for index in range(200):
        masked, labels = masker(ids, epoch=0, sample_index=index)
        for position in (0, 2, 4, 6, 7, 8):
            assert labels[position] == IGNORE_INDEX and masked[position] == ids[position]


def test_masking_depends_only_on_seed_epoch_and_sample_index():
    residues = list(np.random.default_rng(3).integers(4, 24, size=200))
    a, b, c = sample(residues, 11), sample(residues, 12), sample(residues[:50], 13)
    collate = BSHDCollator(make_masker(seed=5), PAD)
    first = collate([a, b])
    second = collate([b, c])
    # Sample b gets the same mask whatever it is batched with and wherever it sits in the batch.
    assert torch.equal(first["labels"][1, :202], second["labels"][0, :202])
    assert torch.equal(first["input_ids"][1, :202], second["input_ids"][0, :202])
    # Same residues, other identity / epoch / seed: another mask.
    assert not torch.equal(first["labels"][0], first["labels"][1])
    again = collate([sample(residues, 12, epoch=1)])
    assert not torch.equal(again["labels"][0], first["labels"][1])
    other_seed = BSHDCollator(make_masker(seed=6), PAD)([b])
    assert not torch.equal(other_seed["labels"][0], first["labels"][1])


def test_batch_without_masked_token_gets_one():
    masker = make_masker(p=1e-9)
    samples = [sample([5, 6, 7], 0), sample([8, 9], 1)]
    for collate in (BSHDCollator(masker, PAD), THDCollator(masker, PAD)):
        labels = collate(samples)["labels"]
        assert (labels != IGNORE_INDEX).sum() == 1


def test_bshd_padding_and_attention_mask():
    samples = [sample([5, 6, 7], 0), sample([8], 1)]
    batch = BSHDCollator(make_masker(), PAD)(samples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert original(batch["input_ids"], batch["labels"]).tolist() == [[0, 5, 6, 7, 2], [0, 8, 2, PAD, PAD]]
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert (batch["labels"][1, 3:] == IGNORE_INDEX).all()

    padded = BSHDCollator(make_masker(), PAD, pad_to_multiple_of=8)(samples)
    assert padded["input_ids"].shape == (2, 8)
    assert padded["attention_mask"].sum(1).tolist() == [5, 3]


def test_thd_packing_boundaries_and_labels():
    samples = [sample([5, 6, 7], 0), sample([8], 1), sample([4, 4, 4, 4, 4], 2)]
    batch = THDCollator(make_masker(p=0.5), PAD)(samples)
    assert set(batch) == {"input_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8, 15]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(batch["cu_seq_lens_k"], batch["cu_seq_lens_q"])
    assert batch["max_length_q"] == batch["max_length_k"] == 7
    assert batch["input_ids"].shape == batch["labels"].shape == (1, 15)
    assert original(batch["input_ids"], batch["labels"])[0].tolist() == [0, 5, 6, 7, 2, 0, 8, 2, 0, 4, 4, 4, 4, 4, 2]
    for boundary in (0, 4, 5, 7, 8, 14):  # <cls>/<eos> of each sequence carry no label
        assert batch["labels"][0, boundary] == IGNORE_INDEX


def test_thd_pad_to_multiple_of_appends_a_pseudo_sequence():
    samples = [sample([5, 6, 7], 0), sample([8], 1), sample([4, 4, 4, 4, 4], 2)]  # 15 tokens
    batch = THDCollator(make_masker(), PAD, pad_to_multiple_of=8)(samples)
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8, 15, 16]
    assert batch["input_ids"][0, 15] == PAD and batch["labels"][0, 15] == IGNORE_INDEX
    assert batch["max_length_q"] == 7

    samples.append(sample([9, 9], 3))  # 19 tokens -> padded to 32 by a 13-token pseudo-sequence
    batch = THDCollator(make_masker(), PAD, pad_to_multiple_of=16)(samples)
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8, 15, 19, 32]
    assert batch["max_length_q"] == 13
    assert (batch["input_ids"][0, 19:] == PAD).all() and (batch["labels"][0, 19:] == IGNORE_INDEX).all()

    exact = THDCollator(make_masker(), PAD, pad_to_multiple_of=5)([sample([5, 6, 7], 0)])
    assert exact["cu_seq_lens_q"].tolist() == [0, 5]  # already a multiple: no pseudo-sequence


@pytest.mark.parametrize(
    ("boundaries", "cp_size", "expected"),
    [
        ([0, 8], 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        ([0, 8], 4, [[0, 7], [1, 6], [2, 5], [3, 4]]),
        ([0, 8, 12], 2, [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]),
        (
            [0, 16, 24],
            4,
            [[0, 1, 14, 15, 16, 23], [2, 3, 12, 13, 17, 22], [4, 5, 10, 11, 18, 21], [6, 7, 8, 9, 19, 20]],
        ),
    ],
)
def test_cp_chunk_assignment(boundaries, cp_size, expected):
    """Each rank's share of a batch whose tokens are their own global positions."""
    cu = torch.tensor(boundaries, dtype=torch.int32)
    batch = {"input_ids": torch.arange(boundaries[-1])[None], "cu_seq_lens_q": cu, "cu_seq_lens_q_padded": cu}
    shares = [shard_for_context_parallel(batch, r, cp_size)["input_ids"][0].tolist() for r in range(cp_size)]
    assert shares == expected


def test_cp_shard_by_hand():
    bshd = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3]),
        "labels": torch.arange(16).reshape(2, 8) + 100,
    }
    shard = shard_for_context_parallel(bshd, cp_rank=1, cp_size=2)
    assert shard["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shard["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert shard["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]

    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    thd = {"input_ids": torch.arange(12)[None], "labels": torch.arange(12)[None] + 100, "cu_seq_lens_q": cu,
           "cu_seq_lens_k": cu, "cu_seq_lens_q_padded": cu, "cu_seq_lens_k_padded": cu, "max_length_q": 8,
           "max_length_k": 8}  # fmt: skip
    shard = shard_for_context_parallel(thd, cp_rank=0, cp_size=2)
    assert shard["input_ids"].tolist() == [[0, 1, 6, 7, 8, 11]]
    assert shard["labels"].tolist() == [[100, 101, 106, 107, 108, 111]]
    assert shard["cu_seq_lens_q"].tolist() == [0, 8, 12]  # the global boundaries travel unchanged to every rank
    assert shard["max_length_q"] == 8


def test_thd_collator_pads_every_sequence_for_cp():
    samples = [sample([5, 6, 7], 0), sample([8], 1)]  # 5 and 3 tokens
    batch = THDCollator(make_masker(), PAD, cp_size=2)(samples)
    assert batch["cu_seq_lens_q_padded"].tolist() == [0, 8, 12]
    assert batch["cu_seq_lens_q"].tolist() == [0, 8, 12]  # CP padding belongs to its sequence (see collator.py)
    assert batch["max_length_q"] == 8
    assert original(batch["input_ids"], batch["labels"])[0].tolist() == [0, 5, 6, 7, 2, 1, 1, 1, 0, 8, 2, 1]

    # FP8 on 2 CP ranks: each local shard must hold a multiple of 16 tokens, so T is padded to 32.
    fp8 = THDCollator(make_masker(), PAD, pad_to_multiple_of=16, cp_size=2)(samples)
    assert fp8["cu_seq_lens_q_padded"].tolist() == [0, 8, 12, 32]
    assert shard_for_context_parallel(fp8, 1, 2)["input_ids"].shape == (1, 16)

    bshd = BSHDCollator(make_masker(), PAD, pad_to_multiple_of=16, cp_size=2)(samples)
    assert bshd["input_ids"].shape == (2, 32)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("collator_cls", [BSHDCollator, THDCollator])
def test_cp_round_trip(cp_size, collator_cls):
    rng = np.random.default_rng(cp_size)
    samples = [sample(list(rng.integers(4, 24, size=n)), i) for i, n in enumerate([1, 6, 17, 30, 9])]
    full = collator_cls(make_masker(), PAD, pad_to_multiple_of=16, cp_size=cp_size)(samples)
    shards = [shard_for_context_parallel(full, r, cp_size) for r in range(cp_size)]
    for shard in shards:
        assert shard["input_ids"].shape[1] * cp_size == full["input_ids"].shape[1]
        assert shard["input_ids"].shape[1] % 16 == 0
    # Every position lands on exactly one rank: shard a batch of positions.
    numbered = dict(full, input_ids=torch.arange(full["input_ids"].numel()).reshape(full["input_ids"].shape))
    positions = torch.cat([shard_for_context_parallel(numbered, r, cp_size)["input_ids"] for r in range(cp_size)], 1)
    assert torch.equal(positions.sort(dim=1).values, numbered["input_ids"])
    rebuilt = unshard_context_parallel(shards)
    assert set(rebuilt) == set(full)
    for key, value in full.items():
        assert torch.equal(rebuilt[key], value) if torch.is_tensor(value) else rebuilt[key] == value


def test_count_targets_counts_the_full_batch_labels():
    samples = [sample([5, 6, 7, 8], 0), sample([9, 9], 1)]
    masker = make_masker(p=0.5)
    expected = sum(int((masker(s["input_ids"], 0, s["sample_index"])[1] != IGNORE_INDEX).sum()) for s in samples)
    assert expected > 0
    for collate in (BSHDCollator(masker, PAD, cp_size=2), THDCollator(masker, PAD, cp_size=2)):
        full = collate(samples)
        assert count_targets(full, causal_lm=False) == expected  # CP padding and BSHD padding carry no label
        shards = [shard_for_context_parallel(full, r, 2) for r in (0, 1)]
        assert sum(count_targets(shard, causal_lm=False) for shard in shards) == expected
