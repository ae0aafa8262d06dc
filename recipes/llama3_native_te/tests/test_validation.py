"""Held-out validation (``validation.Validator`` over ``dataset.held_out_batches``): the loss against one computed by
hand, the split over data-parallel ranks and context-parallel groups, the placeholder batch, the schedule, and the
mistakes that must stop a run before it trains.

The references are independent of the code under test: the hand-computed loss cuts windows with its own loop, runs
each window alone through the model, takes the log-softmax itself and picks the targets from the characters.
"""

import gzip
import json
import math

import pytest
import torch
from dataset import held_out_batches
from grad_accumulation import count_targets
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from omegaconf import OmegaConf
from recipe_paths import recipe_path
from transformers import AutoTokenizer
from user_errors import ConfigError
from validation import Validator


BOS, EOS = 1, 2  # the nucleotide tokenizer: <bos>=1, <eos>=2, a character is its ASCII code
# Lowercase (scored as uppercase), N and x (never scored), sequences of several windows and one shorter than a window.
SEQUENCES = ["ACGTNNacgtTTGACCAGTAGGATCCAxGTTAGC", "GATTACA" * 5, "ccgGA"]
WINDOW, OVERLAP = 16, 4
DATA_CFG = {"max_seq_length": WINDOW, "window_overlap": OVERLAP, "token_budget": 40, "micro_batch_size": 3}
FORMATS = ["thd", "bshd"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(recipe_path("tokenizer"))


@pytest.fixture(scope="module")
def model():
    """The tiny Llama, torch backend, its output layer scaled up so that the next-token distributions differ clearly
    from uniform (at the initial scale every target costs about ln 256, and a wrong target would hardly show)."""
    torch.manual_seed(0)
    config = NVLlamaConfig.from_pretrained(recipe_path("model_configs/llama3-tiny-nucleotide"), backend="torch")
    model = NVLlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(5)
    return model


@pytest.fixture
def valid_file(tmp_path):
    """The sequences as gzipped FASTA, wrapped over lines (the format comes from the name)."""
    path = tmp_path / "valid.fa.gz"
    with gzip.open(path, "wt") as fh:
        for index, sequence in enumerate(SEQUENCES):
            fh.write(f">held_out_{index} some description\n")
            fh.writelines(sequence[i : i + 10] + "\n" for i in range(0, len(sequence), 10))
    return path


def validator(path, tmp_path, tokenizer, input_format="thd", every_n_steps=5, max_batches=None, rank=0, world=1):
    cfg = OmegaConf.create({"path": str(path), "every_n_steps": every_n_steps, "max_batches": max_batches})
    data_cfg = {**DATA_CFG, "input_format": input_format}
    return Validator(
        cfg,
        lambda path: held_out_batches(path, data_cfg, tokenizer, dp_rank=rank, dp_world_size=world),
        dp_rank=rank,
        device=torch.device("cpu"),
        output_dir=tmp_path / f"rank{rank}",
    )


def hand_windows() -> list[list[int]]:
    """<bos> + bases + <eos>, cut into 16-token windows 12 apart until one reaches the end (the last may be short)."""
    windows = []
    for sequence in SEQUENCES:
        tokens = [BOS, *sequence.encode(), EOS]
        start = 0
        while True:
            windows.append(tokens[start : start + WINDOW])
            if start + WINDOW >= len(tokens):
                break
            start += WINDOW - OVERLAP
    return windows


def hand_target(token: int) -> int | None:
    """What the model is asked to predict for ``token``: A/C/G/T (lowercase as uppercase) and <eos>; nothing else."""
    if token == EOS:
        return EOS
    base = chr(token).upper()
    return ord(base) if base in "ACGT" else None


def hand_computed_loss(model) -> tuple[float, int]:
    """Each window alone through the model; every next token with a target scored (a window's first token has no
    context, and <bos> is only ever first)."""
    nll, count = 0.0, 0
    for window in hand_windows():
        with torch.no_grad():
            logits = model(torch.tensor([window])).logits[0].double()
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        for position, token in enumerate(window[1:]):
            target = hand_target(token)
            if target is not None:
                nll -= log_probs[position, target].item()
                count += 1
    return nll / count, count


def batch_windows(batch: dict) -> list[tuple[int, ...]]:
    """The windows a THD or BSHD batch holds (padding dropped)."""
    if "cu_seq_lens_q" in batch:
        ids, bounds = batch["input_ids"][0].tolist(), batch["cu_seq_lens_q"].tolist()
        return [tuple(ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return [tuple(row[mask.bool()].tolist()) for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


def test_hand_windows_hold_what_the_test_needs():
    """The reference itself: several windows per sequence, a short one, lowercase, degenerate bases, <eos>."""
    windows = hand_windows()
    assert len(windows) == 7 and min(len(w) for w in windows) < WINDOW
    targets = [t for w in windows for t in w[1:]]
    assert {hand_target(t) for t in targets} >= {None, EOS, ord("A"), ord("C"), ord("G"), ord("T")}
    assert any(chr(t).islower() for t in targets if t > EOS)


@pytest.mark.parametrize("input_format", FORMATS)
def test_validation_loss_equals_a_hand_computed_one(model, tokenizer, valid_file, tmp_path, input_format):
    expected, count = hand_computed_loss(model)
    assert abs(expected - math.log(256)) > 0.5  # far from uniform: a wrong target or a wrong context would show
    val = validator(valid_file, tmp_path, tokenizer, input_format)
    assert len(list(val.data.read())) == 3  # several batches: THD [16, 16] [12, 16] [16, 13, 7]; BSHD 3 + 3 + 1
    metrics = val.run(model, step=5)
    assert (metrics["step"], metrics["val_tokens"]) == (5, count)
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert json.loads((tmp_path / "rank0" / "validation.jsonl").read_text()) == metrics


@pytest.mark.parametrize("input_format", FORMATS)
def test_two_ranks_score_the_windows_of_one_reader(model, tokenizer, valid_file, tmp_path, input_format):
    """dp_rank 0 and 1 of 2 together hold every window of the file exactly once (rank r: windows r, r + 2, ...),
    and their summed scores are the one reader's."""
    data_cfg = {**DATA_CFG, "input_format": input_format}
    one_reader = held_out_batches(str(valid_file), data_cfg, tokenizer)
    ranks = [held_out_batches(str(valid_file), data_cfg, tokenizer, dp_rank=r, dp_world_size=2) for r in (0, 1)]
    windows = [tuple(w) for w in hand_windows()]
    assert sorted(w for batch in one_reader.read() for w in batch_windows(batch)) == sorted(windows)
    for rank, held_out in enumerate(ranks):
        assert sorted(w for batch in held_out.read() for w in batch_windows(batch)) == sorted(windows[rank::2])
    assert sum(count_targets(b, causal_lm=True) for h in ranks for b in h.read()) == sum(
        count_targets(b, causal_lm=True) for b in one_reader.read()
    )

    whole = validator(valid_file, tmp_path, tokenizer, input_format).run(model, step=1)
    split = [validator(valid_file, tmp_path, tokenizer, input_format, rank=r, world=2).run(model, 1) for r in (0, 1)]
    assert sum(m["val_tokens"] for m in split) == whole["val_tokens"]
    nll = sum(m["val_loss"] * m["val_tokens"] for m in split)
    assert nll == pytest.approx(whole["val_loss"] * whole["val_tokens"], rel=1e-6)


def test_context_parallel_batches_score_what_plain_ones_do(tokenizer, valid_file):
    """cp_size=2: the same batches as full context-parallel ones (padded, targets shifted before the split): every
    batch counts the same scored tokens, and the targets are the same tokens."""
    plain = list(held_out_batches(str(valid_file), DATA_CFG, tokenizer).read())
    cp = list(held_out_batches(str(valid_file), DATA_CFG, tokenizer, cp_size=2).read())
    assert len(cp) == len(plain) == 3
    for plain_batch, cp_batch in zip(plain, cp):
        assert "shift_labels" in cp_batch and "cu_seq_lens_q_padded" in cp_batch
        assert count_targets(cp_batch, causal_lm=True) == count_targets(plain_batch, causal_lm=True) > 0
        assert not (cp_batch["cu_seq_lens_q"] % 4).any()  # every window padded to a multiple of 2 * cp_size
        plain_targets = [t for w in batch_windows(plain_batch) for t in w[1:] if hand_target(t) is not None]
        cp_targets = cp_batch["shift_labels"][cp_batch["shift_labels"] != -100].tolist()
        assert sorted(cp_targets) == sorted(hand_target(t) for t in plain_targets)


@pytest.mark.parametrize(("input_format", "cp_size"), [("thd", 1), ("bshd", 1), ("thd", 2)])
def test_placeholder_scores_nothing(model, tokenizer, valid_file, input_format, cp_size):
    """What a rank without windows of its own runs so that collectives line up: a batch like the others that the
    model runs through and that scores no token (rank 7 of 8 has none of the file's 7 windows)."""
    data_cfg = {**DATA_CFG, "input_format": input_format}
    held_out = held_out_batches(str(valid_file), data_cfg, tokenizer, dp_rank=7, dp_world_size=8, cp_size=cp_size)
    assert list(held_out.read()) == []
    placeholder = held_out.placeholder
    assert count_targets(placeholder, causal_lm=True) == 0
    assert held_out.causal_lm
    if cp_size == 1:
        with torch.no_grad():
            loss = model(**placeholder).loss
        assert torch.isfinite(loss) and loss.item() == 0  # the model's mean over no tokens
    reference = next(iter(held_out_batches(str(valid_file), data_cfg, tokenizer, cp_size=cp_size).read()))
    assert set(placeholder) == set(reference)


def test_validation_changes_nothing_in_training_and_runs_on_schedule(model, tokenizer, valid_file, tmp_path):
    """Training mode comes back, no weight and no random stream moves; due every N steps; max_batches per rank."""
    val = validator(valid_file, tmp_path, tokenizer, every_n_steps=5, max_batches=1)
    assert [step for step in range(1, 16) if val.due(step)] == [5, 10, 15]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng_state = torch.get_rng_state()
    model.train()
    try:
        first = val.run(model, step=5)
        assert model.training
    finally:
        model.eval()
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert 0 < first["val_tokens"] < hand_computed_loss(model)[1]  # max_batches=1 scores only the first batch
    assert val.run(model, step=10)["val_loss"] == first["val_loss"]  # the same batch every time
    lines = (tmp_path / "rank0" / "validation.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [5, 10]  # appended


def test_no_validation_path_means_never(tmp_path):
    cfg = OmegaConf.create({"path": None, "every_n_steps": 0, "max_batches": None})
    val = Validator(cfg, None, dp_rank=0, device=torch.device("cpu"), output_dir=tmp_path)
    assert not val.enabled and not any(val.due(step) for step in range(0, 100))


@pytest.mark.parametrize(
    ("every_n_steps", "max_batches", "message"), [(0, None, "every_n_steps"), (5, 0, "max_batches")]
)
def test_bad_schedule_is_a_config_error(tokenizer, valid_file, tmp_path, every_n_steps, max_batches, message):
    with pytest.raises(ConfigError, match=f"validation.{message} must be >= 1"):
        validator(valid_file, tmp_path, tokenizer, every_n_steps=every_n_steps, max_batches=max_batches)


def test_a_missing_file_fails_when_the_validator_is_built(tokenizer, tmp_path):
    """Before training starts, not at the first evaluation; the message names validation.path, not dataset.path."""
    missing = tmp_path / "missing.fasta"
    with pytest.raises(FileNotFoundError, match=r"validation.path='.*missing.fasta': no such file") as error:
        validator(missing, tmp_path, tokenizer)
    assert "point validation.path at" in str(error.value) and "dataset.path" not in str(error.value)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.fasta", "ACGT\n>s1\nACGT\n", "bad.fasta:1: sequence data before the first '>'"),
        ("bad.jsonl", '{"sequence": "ACGT"}\n{"sequence": \n', "bad.jsonl:2: not a JSON object"),
        ("empty.fasta", "", "validation.path='.*empty.fasta' holds no sequences"),
        ("bad.fasta.gz", "not gzip", "bad.fasta.gz: cannot be read as fasta"),
    ],
)
def test_a_malformed_file_fails_when_the_validator_is_built(tokenizer, tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=message):
        validator(tmp_path / name, tmp_path, tokenizer)


def test_held_out_batches_never_split_a_window(tokenizer, tmp_path):
    """Training packs windows to fill the budget exactly; validation moves a window whole into the next batch (a
    split window's tail would lose its context), and a budget below one window still holds a whole window."""
    path = tmp_path / "long.fasta"
    path.write_text(">long\n" + "ACGT" * 40 + "\n")  # 162 tokens: windows at 0, 12, ..., 156, the last of 6
    for budget in (20, 40):
        batches = list(held_out_batches(str(path), {**DATA_CFG, "token_budget": budget}, tokenizer).read())
        assert [len(w) for b in batches for w in batch_windows(b)] == [WINDOW] * 13 + [6]
        assert all(b["input_ids"].shape[1] <= max(budget, WINDOW) for b in batches)
