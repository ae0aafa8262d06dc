"""Conversion between Hugging Face and NVEsm, and the exported directory, on CPU."""

import pytest
import torch
from esm_testing import make_batch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

from esm2_te.convert import _load_exactly, convert_esm_hf_to_te, convert_esm_te_to_hf
from esm2_te.export import export_hf_checkpoint


def test_round_trip_is_exact(hf_tiny):
    back = convert_esm_te_to_hf(convert_esm_hf_to_te(hf_tiny, backend="torch"))
    original, returned = hf_tiny.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for key in original:
        assert torch.equal(original[key], returned[key]), key


def test_round_trip_keeps_the_contact_head(hf_tiny):
    with torch.no_grad():
        hf_tiny.esm.contact_head.regression.weight.normal_()
    back = convert_esm_te_to_hf(convert_esm_hf_to_te(hf_tiny, backend="torch"))
    assert torch.equal(back.esm.contact_head.regression.weight, hf_tiny.esm.contact_head.regression.weight)


def test_conversion_names_missing_and_mismatched_weights(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    nv_model.esm.encoder.layers[0].layernorm_mlp.fc1_weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(
        ValueError, match=r"shape mismatch.*layer\.0\.intermediate\.dense\.weight: checkpoint \(3, 3\)"
    ):
        convert_esm_te_to_hf(nv_model)


def test_loading_names_missing_and_unexpected_keys(hf_tiny):
    nv_model = convert_esm_hf_to_te(hf_tiny, backend="torch")
    state = {k: v for k, v in nv_model.state_dict().items() if k != "lm_head.dense.bias"}
    state["lm_head.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['lm_head.dense.bias'\].*unexpected keys \(1\)"):
        _load_exactly(nv_model, state, "a test checkpoint")


def test_conversion_rejects_unknown_hugging_face_weights(hf_tiny):
    hf_tiny.register_buffer("surprise", torch.zeros(2))
    with pytest.raises(ValueError, match="surprise"):
        convert_esm_hf_to_te(hf_tiny, backend="torch")


def test_export_reloads_through_auto_classes_offline(hf_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_tiny.save_pretrained(tmp_path / "hf")
    out = export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_esm_te.py", "torch_layers.py", "tokenizer.json"} <= names
    assert {"README.md", "LICENSE"} <= names
    assert not any(name.startswith(".") for name in (p.name for p in tmp_path.iterdir()))  # no staging leftovers

    # backend="torch" overrides the exported "auto", so this CPU comparison holds on GPU machines too.
    model = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    assert type(model).__name__ == "NVEsmForMaskedLM" and model.backend == "torch"
    assert model.config.auto_map["AutoModelForMaskedLM"] == "modeling_esm_te.NVEsmForMaskedLM"
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    batch = tokenizer(["MKTAYIAKQRQISFVK", "MSEQ"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = hf_tiny(**batch).logits
        actual = model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (actual[real] - expected[real]).abs().max() <= 1e-4

    encoder = AutoModel.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state
        expected_hidden = hf_tiny.esm(**batch).last_hidden_state
    assert (hidden[real] - expected_hidden[real]).abs().max() <= 1e-4


def test_export_loads_into_the_stock_hugging_face_model_after_conversion(hf_tiny, tmp_path):
    """Exported weights converted back give a stock EsmForMaskedLM equal to the original."""
    hf_tiny.save_pretrained(tmp_path / "hf")
    out = export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")
    reloaded = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, backend="torch")
    stock = convert_esm_te_to_hf(reloaded).eval()
    input_ids, attention_mask, _ = make_batch([12, 8])
    with torch.no_grad():
        assert torch.equal(
            stock(input_ids, attention_mask=attention_mask).logits,
            hf_tiny(input_ids, attention_mask=attention_mask).logits,
        )
