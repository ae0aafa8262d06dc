# Copied from common/protein/validation_data.py — edit the source, then run ci/check_copies.py --fix
"""The held-out protein batches that ``validation.Validator`` scores every ``validation.every_n_steps`` steps.

``held_out_batches(path, data_cfg, tokenizer, dp_rank, dp_world_size, seed, cp_size)`` reads, validates and
tokenizes the held-out sequences once (with the training data's rules: ``invalid_residue_policy``,
``long_sequence_policy``, ``max_seq_length``), so a missing or malformed file stops the run before it trains. Rank r
of n scores the usable rows r, r + n, ... in file order, in batches built as the training batches are (THD: as many
rows as fit ``token_budget``; BSHD: ``micro_batch_size`` rows; padded for context parallelism). The masks are drawn
from ``(seed, row)``, so every evaluation scores the same masked tokens and the curve shows the model changing, not
the sample.
"""

import numpy as np
from collator import BSHDCollator, MLMMasker, THDCollator, round_up
from dataset import (
    KEPT,
    SequencePolicy,
    TokenizedRows,
    load_sequences,
    local_rank_zero_first,
    residue_token_ids,
    resolve_data_config,
    tokenize_dataset,
)
from epoch_batch_sampler import batches_in_order
from user_errors import ConfigError
from validation import HeldOutBatches


def held_out_batches(
    path: str,
    data_cfg,
    tokenizer,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    seed: int = 0,
    cp_size: int = 1,
    split: str = "validation",
) -> HeldOutBatches:
    """This rank's held-out batches of ``path`` (a file, glob or directory, its format from the names; or a Hugging
    Face dataset name, its ``split``), with the batching and policies of the ``dataset`` config ``data_cfg``."""
    cfg = resolve_data_config({**dict(data_cfg), "path": path, "format": "auto", "streaming": False, "split": split})
    policy_keys = ("max_seq_length", "invalid_residue_policy", "long_sequence_policy")
    policy = SequencePolicy.from_tokenizer(tokenizer, **{key: cfg[key] for key in policy_keys})
    source_keys = ("format", "sequence_column", "split", "name", "streaming", "cache_dir")
    with local_rank_zero_first():
        ds = load_sequences(path, **{key: cfg[key] for key in source_keys}, key="validation.path")
        ds, stats = tokenize_dataset(ds, tokenizer, policy, seed, cfg["sequence_column"], path, cfg["num_proc"])
    stats.log(f"validation data {path}")
    usable = np.flatnonzero(ds.data.column("skip").to_numpy() == KEPT)
    if len(usable) == 0:
        raise ConfigError(f"validation.path {path!r} holds no usable sequence; point it at protein sequences")

    segment_multiple = 2 * cp_size if cp_size > 1 else 1
    lengths = round_up(ds.data.column("length").to_numpy(), segment_multiple)
    thd = cfg["input_format"] == "thd"
    batching = {"token_budget": cfg["token_budget"]} if thd else {"micro_batch_size": cfg["micro_batch_size"]}
    groups = batches_in_order(usable[dp_rank::dp_world_size], lengths, **batching)
    rows = TokenizedRows(ds)
    masker = MLMMasker.from_tokenizer(
        tokenizer, seed=seed, mlm_probability=cfg["mlm_probability"], random_token_ids=residue_token_ids(tokenizer)
    )
    collator_cls = THDCollator if thd else BSHDCollator
    collate = collator_cls(masker, tokenizer.pad_token_id, cfg["pad_to_multiple_of"], cp_size)

    def read():
        for group in groups:
            yield collate(rows.__getitems__([(0, int(row)) for row in group]))

    # <cls><eos> (or <bos><eos>), nothing to mask: what a rank without held-out rows runs so collectives line up.
    first = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    empty = np.array([first, tokenizer.eos_token_id], dtype=np.int64)
    placeholder = collate([{"input_ids": empty, "epoch": 0, "sample_index": 0}])
    placeholder["labels"].fill_(-100)
    return HeldOutBatches(
        read=read,
        placeholder=placeholder,
        causal_lm=False,
        description=f"{len(usable)} usable sequences of {path}; data-parallel rank {dp_rank} of {dp_world_size} "
        f"scores {sum(len(g) for g in groups)} of them in {len(groups)} batch(es), masked from seed {seed}",
    )
