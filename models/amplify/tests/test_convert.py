"""Conversion of the published layout: errors that name the weights at fault, the rotary channel permutation, and
the export CLI in both directions. The round trip through the model and the export's loading are in the model
contract (test_model_contract.py)."""

import json

import pytest
import torch
from amplify_reference import rotate_interleaved
from amplify_testing import reference_model
from safetensors.torch import load_file

from amplify_te.convert import (
    convert_amplify_hf_to_te,
    convert_amplify_te_to_hf,
    half_split_to_interleaved,
    interleaved_to_half_split,
)
from amplify_te.export import main as export_main
from amplify_te.torch_layers import apply_rotary_pos_emb


def published(model):
    return model.state_dict(), model.config.to_dict()


def test_missing_and_extra_published_weights_are_named(reference_tiny):
    state, config = published(reference_tiny)
    del state["transformer_encoder.1.ffn.w3.weight"]
    state["transformer_encoder.2.q.weight"] = torch.zeros(64, 64)  # a third layer the config does not have
    with pytest.raises(
        ValueError,
        match=r"missing keys \['transformer_encoder\.1\.ffn\.w3\.weight'\].*"
        r"unexpected keys \['transformer_encoder\.2\.q\.weight'\]",
    ):
        convert_amplify_hf_to_te(state, config, backend="torch")


def test_a_final_norm_the_config_does_not_announce_is_named(reference_tiny):
    state, config = published(reference_tiny)
    config["layer_norm_before_last_layer"] = False
    with pytest.raises(ValueError, match=r"unexpected keys \['layer_norm_2\.weight'\]"):
        convert_amplify_hf_to_te(state, config, backend="torch")


def test_wrongly_shaped_published_weight_is_named(reference_tiny):
    state, config = published(reference_tiny)
    state["transformer_encoder.0.ffn.w12.weight"] = torch.zeros(10, 64)
    with pytest.raises(ValueError, match=r"shape mismatch.*layers\.0\.layernorm_mlp\.fc1_weight"):
        convert_amplify_hf_to_te(state, config, backend="torch")


def test_rotary_permutation_turns_interleaved_pairs_into_half_split_pairs():
    """Rotating interleaved pairs of x, then permuting, equals permuting x, then rotating half-split pairs (TE's and
    the torch twin's form): the identity the conversion relies on, checked on the twin's own rotary function."""
    heads, head_dim, seq = 3, 8, 5
    x = torch.randn(1, seq, heads, head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1).view(seq, 1, 1, head_dim)

    def permute(t):  # the conversion's permutation, applied to activations [.., heads, head_dim]
        rows = t.reshape(-1, heads * head_dim).T  # the permutation acts on weight rows = output channels
        return interleaved_to_half_split(rows, heads).T.reshape(t.shape)

    expected = permute(rotate_interleaved(x, angles))
    actual = apply_rotary_pos_emb(permute(x), freqs, "bshd")
    assert torch.allclose(actual, expected, atol=1e-6)


def test_rotary_permutation_inverts_exactly():
    weight = torch.randn(10 * 64, 640)
    moved = interleaved_to_half_split(weight, 10)
    assert not torch.equal(moved, weight)
    assert torch.equal(half_split_to_interleaved(moved, 10), weight)


def test_conversion_keeps_the_checkpoint_dtype(reference_tiny):
    state, config = published(reference_tiny.to(torch.bfloat16))
    nv_model = convert_amplify_hf_to_te(state, config, backend="torch")
    assert all(p.dtype == torch.bfloat16 for p in nv_model.parameters())
    back, _ = convert_amplify_te_to_hf(nv_model)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
def test_export_cli_converts_a_published_directory_and_back_exactly(tmp_path, weights_file):
    reference = reference_model()
    published_dir = tmp_path / "AMPLIFY_tiny"
    reference.save_pretrained(published_dir)
    if weights_file == "pytorch_model.bin":  # an older download: a pickled state dict instead of safetensors
        torch.save(reference.state_dict(), published_dir / "pytorch_model.bin")
        (published_dir / "model.safetensors").unlink()

    export_main(["--source", str(published_dir), "--output-dir", str(tmp_path / "te")])
    export_main(["--to-published", "--source", str(tmp_path / "te"), "--output-dir", str(tmp_path / "again")])

    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(again[key], value), key
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["model_type"] == "AMPLIFY" and config["architectures"] == ["AMPLIFY"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "norm_eps"):
        assert config[key] == getattr(reference.config, key), key
    assert (tmp_path / "again" / "tokenizer.json").is_file()


def test_export_of_a_bf16_request_holds_bf16_weights(tmp_path):
    reference = reference_model()
    reference.save_pretrained(tmp_path / "published")
    export_main(["--source", str(tmp_path / "published"), "--output-dir", str(tmp_path / "te"), "--dtype", "bfloat16"])
    weights = load_file(tmp_path / "te" / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "te" / "config.json").read_text())["model_type"] == "esm"


def test_a_rotary_base_the_published_layout_cannot_hold_is_refused(reference_tiny):
    """The published code fixes the rotary base at 1e4 and its config has no such field: a model with another
    rope_theta would compute otherwise there, so it is not written in that layout."""
    state, config = published(reference_tiny)
    nv_model = convert_amplify_hf_to_te(state, config, backend="torch", rope_theta=500_000.0)
    with pytest.raises(ValueError, match="rope_theta=500000.0"):
        convert_amplify_te_to_hf(nv_model)
