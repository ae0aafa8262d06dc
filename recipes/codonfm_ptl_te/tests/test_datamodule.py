"""datamodule.py: THD and BSHD masked-LM batches, fine-tuning and prediction batches, data-parallel shards that are
disjoint and complete, and exact resume through Lightning (an interrupted run sees the batches of an uninterrupted
one). Batches are checked against the sequences written here: every sequence is unique, so a batch row is identified
by its unmasked tokens."""

import json
from types import SimpleNamespace

import lightning
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datamodule import ENDLESS, CodonDataModule, equal_count_batches, resolve_data_config
from launch import run_script
from user_errors import ConfigError


CODONS = [a + b + c for a in "ACGT" for b in "ACGT" for c in "ACGT"]


def codon_ids(sequence: str) -> tuple[int, ...]:
    """<CLS> codons <SEP> from the codon table (independent of sequences.encode)."""
    return (0, *(5 + CODONS.index(sequence[i : i + 3]) for i in range(0, len(sequence), 3)), 1)


@pytest.fixture
def corpus(tmp_path):
    """60 unique sequences of 3-30 codons in a Parquet file; returns (path, {token tuple: row})."""
    rng = np.random.default_rng(0)
    sequences = ["".join(rng.choice(CODONS, int(rng.integers(3, 31)))) for _ in range(60)]
    assert len(set(sequences)) == 60
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(60)], "sequence": sequences}), path)
    return path, {codon_ids(s): row for row, s in enumerate(sequences)}


def make_module(path, **overrides):
    cfg = {"train_path": str(path), "val_fraction": 0.0, "num_workers": 0, "token_budget": 128, "max_codons": 40}
    return CodonDataModule({**cfg, **overrides})


def originals(batch) -> list[tuple[int, ...]]:
    """Each sequence of a masked batch with its masked positions restored from the labels."""
    restored = torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])
    if "cu_seq_lens_q" in batch:
        bounds = batch["cu_seq_lens_q"].tolist()
        return [tuple(restored[0, a:b].tolist()) for a, b in zip(bounds, bounds[1:])]
    return [tuple(row[mask.bool()].tolist()) for row, mask in zip(restored, batch["attention_mask"])]


def first_epoch_rows(module, lookup) -> list[int]:
    """The rows this rank trains on in data epoch 0 (its first ``batches_per_epoch()`` batches), in order."""
    batches = zip(range(module.batches_per_epoch()), module.train_dataloader())
    return [lookup[seq] for _, batch in batches for seq in originals(batch)]


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"train_pth": "x"}, "unknown data config keys \\['train_pth'\\]"),
        ({"task": "mlm2"}, "data.task must be one of"),
        ({"task": "regression"}, "set data.input_format=bshd"),
        ({"input_format": "sbhd"}, "input_format must be thd or bshd"),
        ({"invalid_codon_policy": "drop"}, "invalid_codon_policy must be one of"),
        ({"token_budget": 100, "max_codons": 100}, "token_budget=100 < max_codons \\+ 2 = 102"),
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer"),
        ({"mlm_probability": 1.5}, "mlm_probability must be a number in \\[0, 1\\]"),
        ({"mlm_probability": "high"}, "mlm_probability must be a number"),
        ({"val_fraction": 1.0}, "val_fraction must be a number in \\[0, 1\\)"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be a positive integer or null"),
        ({"num_classes": 1}, "num_classes must be an integer >= 2"),
    ],
)
def test_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        resolve_data_config(override)


def test_setup_needs_a_train_path():
    with pytest.raises(ConfigError, match="data.train_path is not set"):
        CodonDataModule({}).setup("fit")


def test_trainer_must_leave_sampling_to_the_module(corpus):
    module = make_module(corpus[0])
    connector = SimpleNamespace(use_distributed_sampler=True)
    module.trainer = SimpleNamespace(global_rank=0, world_size=2, _accelerator_connector=connector)
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        module.setup("fit")


# ------------------------------------------------------------------------------------------------ MLM batches


def test_thd_batches_pack_whole_sequences_within_the_budget(corpus):
    path, lookup = corpus
    module = make_module(path, token_budget=128, mlm_probability=0.3)
    module.setup("fit")
    loader = module.train_dataloader()
    assert len(loader) == ENDLESS
    n_labels = n_codons = 0
    for _, batch in zip(range(20), loader):
        ids, labels, cu = batch["input_ids"], batch["labels"], batch["cu_seq_lens_q"]
        assert ids.shape == labels.shape == (1, cu[-1].item()) and ids.shape[1] <= 128
        assert cu.dtype == torch.int32 and torch.equal(cu, batch["cu_seq_lens_k"])
        sequences = originals(batch)
        assert all(seq in lookup for seq in sequences)  # whole sequences, in their segments
        assert batch["max_length_q"] == max(len(s) for s in sequences)
        lengths = [len(s) for s in sequences]
        assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
        # Only codons are selected, and random replacements are codons.
        restored = torch.where(labels != -100, labels, ids)
        assert (labels[restored < 5] == -100).all()
        assert ((ids[labels != -100] >= 4) & (ids[labels != -100] < 69)).all()
        n_labels += (labels != -100).sum().item()
        n_codons += (restored >= 5).sum().item()
    assert 0.25 < n_labels / n_codons < 0.35


def test_bshd_batches(corpus):
    path, lookup = corpus
    module = make_module(path, input_format="bshd", micro_batch_size=7, pad_to_multiple_of=8)
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape[0] == 7 and batch["input_ids"].shape[1] % 8 == 0
    sequences = originals(batch)
    assert all(seq in lookup for seq in sequences)
    assert batch["attention_mask"].sum(1).tolist() == [len(s) for s in sequences]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 3).all()  # <PAD>
    assert module.batches_per_epoch() == 9  # ceil(60 / 7)


def test_a_sequence_gets_the_same_mask_in_any_batch(corpus):
    """Masks are a function of (seed, epoch, row): BSHD batches of 2 and of 5 mask each sequence alike."""
    path, _ = corpus
    masks = []
    for size in (2, 5):
        module = make_module(path, input_format="bshd", micro_batch_size=size)
        module.setup("fit")
        seen = {}
        for _, batch in zip(range(6), module.train_dataloader()):
            for seq, labels, mask in zip(originals(batch), batch["labels"], batch["attention_mask"]):
                seen[seq] = labels[mask.bool()].tolist()
        masks.append(seen)
    common = set(masks[0]) & set(masks[1])
    assert len(common) >= 10 and all(masks[0][s] == masks[1][s] for s in common)


# ----------------------------------------------------------------------------------------- data parallelism


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("input_format", ["thd", "bshd"])
def test_dp_shards_are_disjoint_and_complete(corpus, world, input_format):
    path, lookup = corpus
    shards = []
    for rank in range(world):
        module = make_module(path, input_format=input_format, micro_batch_size=4)
        module.trainer = SimpleNamespace(global_rank=rank, world_size=world, _accelerator_connector=None)
        module.setup("fit")
        shards.append(first_epoch_rows(module, lookup))
    assert all(len(shard) == 60 // world for shard in shards)  # drop_last: equal shares, < world left out
    flat = [row for shard in shards for row in shard]
    assert len(set(flat)) == len(flat) == world * (60 // world)


def test_lightning_ddp_ranks_train_and_validate_on_disjoint_complete_shares(tmp_path, corpus):
    """Two gloo processes under torchrun, Lightning's DDP strategy: the ranks come from the Trainer."""
    path, lookup = corpus
    run_script("tests/scripts/ddp_data_worker.py", str(path), str(tmp_path), "thd", nproc=2)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    epoch0 = [[lookup[tuple(s)] for batch in r["train"][: r["batches_per_epoch"]] for s in batch] for r in results]
    assert [len(rows) for rows in epoch0] == [22, 22]  # 45 training rows (15 held out), one left out
    assert set(epoch0[0]).isdisjoint(epoch0[1]) and len(set(epoch0[0])) == 22
    trained = {lookup[tuple(s)] for r in results for batch in r["train"] for s in batch}
    val = [[lookup[tuple(s)] for s in r["val"]] for r in results]
    assert [len(rows) for rows in val] == [7, 7] and set(val[0]).isdisjoint(val[1])
    assert trained.isdisjoint(val[0] + val[1]) and len(trained) == 45


def test_validation_split_and_equal_batch_counts(corpus):
    path, lookup = corpus
    world, shards, counts = 3, [], []
    for rank in range(world):
        module = make_module(path, val_fraction=0.5, token_budget=100)
        module.trainer = SimpleNamespace(global_rank=rank, world_size=world, _accelerator_connector=None)
        module.setup("fit")
        val_batches = list(module.val_dataloader())
        counts.append(len(val_batches))
        shards.append([lookup[s] for b in val_batches for s in originals(b)])
        assert set(module.val_rows.tolist()).isdisjoint(module.train_rows.tolist())
        train_rows = first_epoch_rows(module, lookup)
        assert set(train_rows) <= set(module.train_rows.tolist())
        # Validation masks are fixed: a second pass gives the same batches.
        again = list(module.val_dataloader())
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(val_batches, again))
    assert len(set(counts)) == 1  # every rank runs the same number of validation steps (FSDP)
    flat = [row for shard in shards for row in shard]
    assert len(set(flat)) == len(flat) == 30  # 30 held out, 10 per rank
    assert set(flat) == set(module.val_rows.tolist())


def test_equal_count_batches_splits_the_largest():
    lengths = np.array([50, 50, 50, 50, 10, 10, 10, 10])
    per_rank = equal_count_batches([np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])], lengths, token_budget=100)
    assert [len(b) for b in per_rank] == [2, 2]
    assert per_rank[1] == [[4, 5], [6, 7]] and per_rank[0] == [[0, 1], [2, 3]]


def test_no_validation_data(corpus):
    module = make_module(corpus[0], val_fraction=0.0)
    module.setup("fit")
    assert module.val_dataloader() == []


# ------------------------------------------------------------------------------------ fine-tuning, prediction


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_finetune_batches(tmp_path, task):
    rng = np.random.default_rng(1)
    sequences = ["".join(rng.choice(CODONS, int(rng.integers(2, 12)))) for _ in range(20)]
    labels = [float(i % 3) + (0.25 if task == "regression" else 0.0) for i in range(20)]
    path = tmp_path / "ft.csv"
    path.write_text("sequence,y\n" + "".join(f"{s},{y}\n" for s, y in zip(sequences, labels)))
    module = CodonDataModule({"train_path": str(path), "task": task, "label_column": "y", "input_format": "bshd",
                              "micro_batch_size": 4, "val_fraction": 0.2, "num_workers": 0})  # fmt: skip
    module.setup("fit")
    expected = {codon_ids(s): y for s, y in zip(sequences, labels)}
    for batch in [next(iter(module.train_dataloader())), *module.val_dataloader()]:
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        assert batch["labels"].dtype == (torch.float32 if task == "regression" else torch.int64)
        for row, mask, label in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
            assert expected[tuple(row[mask.bool()].tolist())] == label.item()  # unmasked, label of its sequence
    assert module.num_classes == (3 if task == "classification" else None)


def test_finetune_ranks_hold_as_many_sequences_in_every_batch(tmp_path):
    """Each rank's fine-tuning micro-batch holds as many sequences as every other rank's, the short batch at an
    epoch's end included: the ranks' gradient average of their sequence-mean losses then weighs every sequence
    alike, so the fine-tuning loss needs no data-parallel weight (lightning_module.EncodonFinetuneModule)."""
    path = tmp_path / "ft.csv"
    path.write_text("sequence,y\n" + "".join(f"{'ATG' * (i % 5 + 1)},{i}\n" for i in range(23)))
    sizes = []
    for rank in range(3):  # 7 rows each (23 // 3): batches of 3, 3, 1 per epoch
        module = CodonDataModule({"train_path": str(path), "task": "regression", "label_column": "y",
                                  "input_format": "bshd", "micro_batch_size": 3, "val_fraction": 0.0,
                                  "num_workers": 0}, dp_rank=rank, dp_world_size=3)  # fmt: skip
        module.setup("fit")
        sizes.append([batch["labels"].shape[0] for _, batch in zip(range(8), module.train_dataloader())])
    assert sizes[0] == [3, 3, 1, 3, 3, 1, 3, 3] and sizes[1] == sizes[0] and sizes[2] == sizes[0]


def test_classification_labels_beyond_num_classes(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("sequence,label\nATG,0\nCCC,3\nGGG,1\n")
    module = CodonDataModule({"train_path": str(path), "task": "classification", "input_format": "bshd",
                              "num_classes": 3, "val_fraction": 0.0})  # fmt: skip
    with pytest.raises(ConfigError, match="a label is 3, but data.num_classes=3"):
        module.setup("fit")


def test_predict_batches_cover_the_file_in_order(tmp_path):
    path = tmp_path / "p.fa"
    sequences = ["ATG" * (i + 1) for i in range(11)]
    path.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(sequences)))
    names, rows = [], []
    for rank in range(2):
        module = CodonDataModule({"predict_path": str(path), "micro_batch_size": 4, "num_workers": 0},
                                 dp_rank=rank, dp_world_size=2)  # fmt: skip
        module.setup("predict")
        for batch in module.predict_dataloader():
            names += batch["names"]
            rows += batch["sample_index"].tolist()
            for name, ids, mask in zip(batch["names"], batch["input_ids"], batch["attention_mask"]):
                assert tuple(ids[mask.bool()].tolist()) == codon_ids(sequences[int(name[1:])])  # nothing masked
    assert names == [f"p{i}" for i in range(11)] and rows == list(range(11))


def test_predict_through_lightning(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("id,sequence\n" + "".join(f"q{i},{'CCC' * (i + 1)}\n" for i in range(5)))

    class Names(lightning.LightningModule):
        def predict_step(self, batch, batch_idx):
            return batch["names"]

    module = CodonDataModule({"predict_path": str(path), "micro_batch_size": 2, "num_workers": 0})
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    predictions = trainer.predict(Names(), datamodule=module)
    assert [n for batch in predictions for n in batch] == [f"q{i}" for i in range(5)]


# ------------------------------------------------------------------------------------- resume through Lightning


class Recorder(lightning.LightningModule):
    """Records every training batch it is given; one parameter so that there is an optimizer step."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append({key: batch[key].clone() for key in ("input_ids", "labels", "cu_seq_lens_q")})
        return self.weight * batch["input_ids"].float().mean()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, path, max_steps, num_workers, ckpt_path=None, save_at=None):
    module, data = Recorder(), make_module(path, token_budget=96, num_workers=num_workers, val_fraction=0.1)
    callbacks = []
    if save_at:
        callbacks.append(lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=save_at, save_top_k=-1, filename="step{step}"))  # fmt: skip
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=4, check_val_every_n_epoch=None,
        limit_val_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(save_at), callbacks=callbacks, use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module.seen, data


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_sees_the_batches_of_an_uninterrupted_run(tmp_path, corpus, num_workers):
    """Stop after 7 steps (a checkpoint that Lightning writes mid-run), resume with ckpt_path: steps 8..20 are the
    uninterrupted run's, across data epochs (an epoch here is ~10 batches) and validation runs."""
    path, lookup = corpus
    full, data = fit(tmp_path / "full", path, 20, num_workers)
    first, _ = fit(tmp_path / "part", path, 7, num_workers, save_at=7)
    checkpoint = tmp_path / "part" / "ckpt" / "stepstep=7.ckpt"
    state = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert "combined_loader" in state  # Lightning stored the loader position
    rest, _ = fit(tmp_path / "rest", path, 20, num_workers, ckpt_path=checkpoint)

    assert len(full) == 20 and len(first) == 7 and len(rest) == 13
    for a, b in zip(first + rest, full):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    rows = [lookup[s] for batch in full for s in originals(batch)]
    assert len(rows) > len(data.train_rows)  # more than one data epoch went by
