"""The validation loop against a loss computed by hand, its schedule, its output, and errors that must propagate."""

import gzip
import json
import math

import pytest
import torch
from dataset import held_out_batches
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from omegaconf import OmegaConf
from recipe_paths import recipe_path
from transformers import AutoTokenizer
from validation import Validator


SEQUENCES = ["ACGTNNacgtTTGACCAGTAGGATCCAxG", "GATTACA" * 5]


def write_validation_file(path):
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps({"text": s}) + "\n" for s in SEQUENCES)
    return path


def validator(path, tmp_path, every_n_steps=5, max_batches=None) -> Validator:
    cfg = OmegaConf.create({"path": str(path), "every_n_steps": every_n_steps, "max_batches": max_batches})
    data_cfg = {"max_seq_length": 16, "window_overlap": 4, "token_budget": 20}
    tokenizer = AutoTokenizer.from_pretrained(recipe_path("tokenizer"))
    return Validator(
        cfg,
        lambda path: held_out_batches(path, data_cfg, tokenizer),
        dp_rank=0,
        device=torch.device("cpu"),
        output_dir=tmp_path,
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = NVLlamaConfig.from_pretrained(recipe_path("model_configs/llama3-tiny-nucleotide"), backend="torch")
    return NVLlamaForCausalLM(config).eval()


def hand_computed_loss(model) -> tuple[float, int]:
    """Cut <bos> + bases + <eos> into 16-token windows 12 apart, run each window alone, take log-softmax by hand and
    score every next token that is A/C/G/T (lowercase as uppercase) or <eos>."""
    nll, count = 0.0, 0
    for sequence in SEQUENCES:
        tokens = [1, *sequence.encode(), 2]  # the nucleotide tokenizer: <bos>=1, <eos>=2, a base is its ASCII code
        start = 0
        while True:
            window = tokens[start : start + 16]
            with torch.no_grad():
                logits = model(torch.tensor([window])).logits[0].double()
            log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            for i, target in enumerate(window[1:]):
                char = chr(target).upper() if target > 2 else None
                if target == 2 or char in ("A", "C", "G", "T"):
                    nll -= log_probs[i, 2 if target == 2 else ord(char)].item()
                    count += 1
            if start + 16 >= len(tokens):
                break
            start += 12
    return nll / count, count


def test_validation_loss_equals_a_hand_computed_one(model, tmp_path):
    expected, count = hand_computed_loss(model)
    metrics = validator(write_validation_file(tmp_path / "v.jsonl.gz"), tmp_path).run(model, step=5)
    assert metrics["val_tokens"] == count
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert json.loads((tmp_path / "validation.jsonl").read_text()) == metrics


def test_validation_restores_training_mode_and_runs_on_schedule(model, tmp_path):
    val = validator(write_validation_file(tmp_path / "v.jsonl.gz"), tmp_path, every_n_steps=5, max_batches=1)
    assert [step for step in range(1, 16) if val.due(step)] == [5, 10, 15]
    model.train()
    first = val.run(model, step=5)
    assert model.training
    assert first["val_tokens"] < hand_computed_loss(model.eval())[1]  # max_batches=1 scores only the first batch


def test_no_validation_path_means_never(tmp_path):
    cfg = OmegaConf.create({"path": None, "every_n_steps": 0, "max_batches": None})
    val = Validator(cfg, None, dp_rank=0, device=torch.device("cpu"), output_dir=tmp_path)
    assert not val.enabled and not any(val.due(step) for step in range(1, 100))


def test_errors_in_validation_propagate(model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ACGT"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        validator(bad, tmp_path).run(model, step=5)
    with pytest.raises(FileNotFoundError, match="validation.path .*missing.jsonl.gz' does not exist"):
        validator(tmp_path / "missing.jsonl.gz", tmp_path)  # before training starts, not at the first evaluation
