"""Conversion between Hugging Face and NVLlama, and the exported directory, on CPU."""

import pytest
import torch
from llama_testing import TINY_SHAPE, hf_llama_config, make_batch, randomize_
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from llama3_te.convert import _load_exactly, convert_llama_hf_to_te, convert_llama_te_to_hf, interleave_qkv
from llama3_te.export import export_hf_checkpoint


@pytest.fixture(params=["untied", "tied"])
def hf_model(request, hf_tiny) -> LlamaForCausalLM:
    if request.param == "untied":
        return hf_tiny
    torch.manual_seed(1)
    return randomize_(LlamaForCausalLM(hf_llama_config(tie_word_embeddings=True, **TINY_SHAPE)), 1).eval()


def test_round_trip_is_exact(hf_model):
    back = convert_llama_te_to_hf(convert_llama_hf_to_te(hf_model, backend="torch"))
    original, returned = hf_model.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for key in original:
        assert torch.equal(original[key], returned[key]), key
    tied = hf_model.config.tie_word_embeddings
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied


def test_fused_qkv_follows_te_group_layout():
    """Per key/value group: that group's query heads, then its key head, then its value head."""
    heads, groups, head_dim, hidden = 4, 2, 3, 5
    q = torch.arange(heads * head_dim).repeat_interleave(hidden).view(heads * head_dim, hidden).float()
    k = 100 + torch.arange(groups * head_dim).repeat_interleave(hidden).view(groups * head_dim, hidden).float()
    v = 200 + torch.arange(groups * head_dim).repeat_interleave(hidden).view(groups * head_dim, hidden).float()
    fused = interleave_qkv(q, k, v, groups)[:, 0].tolist()
    expected = [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201, 202, 6, 7, 8, 9, 10, 11, 103, 104, 105, 203, 204, 205]
    assert fused == expected


def test_conversion_names_mismatched_weights(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    nv_model.model.layers[0].layernorm_mlp.fc2_weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"shape mismatch.*layers\.0\.mlp\.down_proj\.weight: checkpoint \(3, 3\)"):
        convert_llama_te_to_hf(nv_model)


def test_loading_names_missing_and_unexpected_keys(hf_tiny):
    nv_model = convert_llama_hf_to_te(hf_tiny, backend="torch")
    state = {k: v for k, v in nv_model.state_dict().items() if k != "model.norm.weight"}
    state["lm_head.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['model.norm.weight'\].*unexpected keys \(1\)"):
        _load_exactly(nv_model, state, "a test checkpoint")


def test_conversion_rejects_unknown_hugging_face_weights(hf_tiny):
    hf_tiny.register_buffer("surprise", torch.zeros(2))
    with pytest.raises(ValueError, match="surprise"):
        convert_llama_hf_to_te(hf_tiny, backend="torch")


def test_export_reloads_through_auto_classes_offline(hf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_model.save_pretrained(tmp_path / "hf")
    out = export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_llama_te.py", "torch_layers.py", "tokenizer.json"} <= names
    assert {"README.md", "LICENSE"} <= names
    assert not any(name.startswith(".") for name in (p.name for p in tmp_path.iterdir()))  # no staging leftovers

    # backend="torch" overrides the exported "auto", so this CPU comparison holds on GPU machines too.
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    assert type(model).__name__ == "NVLlamaForCausalLM" and model.backend == "torch"
    assert model.config.auto_map["AutoModelForCausalLM"] == "modeling_llama_te.NVLlamaForCausalLM"
    tied = hf_model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["ACGTTGCAACGTNNRY", "GATTACA"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = hf_model(**batch).logits
        actual = model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (actual[real] - expected[real]).abs().max() <= 1e-4

    decoder = AutoModel.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    input_ids, attention_mask, _ = make_batch([20, 13])
    with torch.no_grad():
        hidden = decoder(input_ids, attention_mask=attention_mask).last_hidden_state
        expected_hidden = hf_model.model(input_ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert (hidden[real] - expected_hidden[real]).abs().max() <= 1e-4


def test_export_converts_back_to_the_stock_model(hf_tiny, tmp_path):
    hf_tiny.save_pretrained(tmp_path / "hf")
    out = export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, backend="torch")
    stock = convert_llama_te_to_hf(reloaded)
    for key, value in hf_tiny.state_dict().items():
        assert torch.equal(stock.state_dict()[key], value), key
