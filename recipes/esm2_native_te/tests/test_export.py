"""The final Hugging Face export: loadable anywhere, and never a half-written directory."""

import pytest
import torch
from checkpoint import export_final_model
from modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM
from transformers import AutoModelForMaskedLM, AutoTokenizer


TOKENIZER_DIR = "tokenizer"


def tiny_model() -> NVEsmForMaskedLM:
    config = NVEsmConfig(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=64, backend="torch"
    )
    return NVEsmForMaskedLM(config)


def test_export_reloads_with_equal_logits_and_portable_config(tmp_path):
    model = tiny_model().eval()
    model.config.layer_precision = ["fp8"]  # a training-time setting that must not reach the export
    out = export_final_model(
        model, model.state_dict(), tmp_path / "final_model", AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    )
    assert model.config.layer_precision == ["fp8"]  # the caller's config is left as it was
    reloaded = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    assert reloaded.config.layer_precision is None and reloaded.config.backend == "torch"
    ids = torch.randint(4, 24, (2, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


class _BrokenTokenizer:
    def save_pretrained(self, _):
        raise OSError("disk full")


def test_failed_export_keeps_the_previous_one(tmp_path):
    model = tiny_model()
    target = tmp_path / "final_model"
    export_final_model(model, model.state_dict(), target, AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(OSError, match="disk full"):
        export_final_model(model, model.state_dict(), target, _BrokenTokenizer())
    assert sorted(p.name for p in target.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]  # no staging directory left behind


def test_export_over_an_earlier_one_replaces_it_whole(tmp_path):
    model = tiny_model()
    target = tmp_path / "final_model"
    export_final_model(model, model.state_dict(), target, AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    (target / "stale.txt").write_text("from an older export")
    export_final_model(model, model.state_dict(), target)
    assert not (target / "stale.txt").exists() and not (target / "tokenizer.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]  # the earlier export moved aside, then deleted


def test_export_that_died_between_its_renames_leaves_the_last_good_one_to_restore(tmp_path):
    """A crash after moving the old export aside and before moving the new one in: the next export restores the old
    one before it starts, so a second failure still leaves a loadable directory."""
    model = tiny_model()
    target = tmp_path / "final_model"
    export_final_model(model, model.state_dict(), target, AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    target.rename(tmp_path / ".final_model.previous")  # the state such a crash leaves
    with pytest.raises(OSError, match="disk full"):
        export_final_model(model, model.state_dict(), target, _BrokenTokenizer())
    assert (target / "tokenizer.json").is_file() and (target / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]
