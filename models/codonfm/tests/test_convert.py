"""Conversion from and to the published layout: a Lightning checkpoint file written by the reference (and back, loaded
by the reference strictly), the other published file forms, the trusted-load rule, errors that name the weights and
settings at fault, and the export CLI. The in-memory round trip and the export's loading are in the model contract."""

import functools
import json

import pytest
import torch
from codonfm_testing import hyper_parameters, make_batch, reference_from_checkpoint, reference_model
from safetensors.torch import save_file

from codonfm_te.convert import (
    PUBLISHED_HPARAMS,
    UntrustedCheckpointError,
    convert_encodon_checkpoint_to_te,
    convert_encodon_te_to_checkpoint,
    load_encodon_checkpoint,
)
from codonfm_te.export import export_published_checkpoint
from codonfm_te.export import main as export_main
from codonfm_te.modeling_codonfm_te import NVEncodonForMaskedLM


def lightning_checkpoint(model, path, pickled_settings: bool = True):
    """What EncodonPL's trainer saves: ``model.``-prefixed weights, and hyper_parameters that (in the published runs)
    include the optimizer and scheduler as pickled partials."""
    hparams = hyper_parameters(model)
    if pickled_settings:
        hparams["optimizer"] = functools.partial(torch.optim.AdamW, lr=1e-4)
    state_dict = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state_dict, "hyper_parameters": hparams, "epoch": 3, "global_step": 1000}, path)
    return path


def same_logits(nv_model, reference) -> bool:
    batch = make_batch([30, 11])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected, actual = reference(**batch).logits, nv_model.eval()(**batch).logits
    return (actual[real] - expected[real]).abs().max().item() < 1e-4


# ------------------------------------------------------------------------------------------ Lightning checkpoints


def test_a_lightning_checkpoint_converts_and_goes_back_to_one_the_reference_loads(tmp_path, reference_tiny):
    path = lightning_checkpoint(reference_tiny, tmp_path / "last.ckpt")
    state_dict, hparams = load_encodon_checkpoint(path, trust_checkpoint=True)
    assert all(key.startswith("model.") for key in state_dict)
    nv_model = convert_encodon_checkpoint_to_te(state_dict, hparams, backend="torch")
    assert same_logits(nv_model, reference_tiny)

    back = export_published_checkpoint(nv_model, tmp_path / "again")
    checkpoint = torch.load(back, weights_only=True)  # only tensors and plain values: the safe default load works
    architecture = {k: v for k, v in hyper_parameters(reference_tiny).items() if k in PUBLISHED_HPARAMS}
    assert checkpoint["hyper_parameters"] == architecture
    reloaded = reference_from_checkpoint(checkpoint["state_dict"], checkpoint["hyper_parameters"])  # strict
    for key, value in reference_tiny.state_dict().items():
        assert torch.equal(checkpoint["state_dict"][f"model.{key}"], value), key
    assert same_logits(nv_model, reloaded.eval())


def test_a_checkpoint_with_pickled_settings_needs_trust(tmp_path, reference_tiny):
    path = lightning_checkpoint(reference_tiny, tmp_path / "last.ckpt")
    with pytest.raises(UntrustedCheckpointError, match="pass trust_checkpoint=True .CLI: --trust-checkpoint."):
        load_encodon_checkpoint(path)
    # Without pickled objects the safe load is enough.
    plain = lightning_checkpoint(reference_tiny, tmp_path / "plain.ckpt", pickled_settings=False)
    state_dict, hparams = load_encodon_checkpoint(plain)
    assert hparams["hidden_size"] == 64 and len(state_dict) == len(reference_tiny.state_dict())


@pytest.mark.parametrize("layout", ["safetensors-file", "directory", "nested-hparams"])
def test_other_published_file_forms(tmp_path, reference_tiny, layout):
    """A .safetensors with config.json beside it (what the published inference code also reads), a directory of both,
    and hyper_parameters nested under "hparams" (some Lightning versions)."""
    hparams = hyper_parameters(reference_tiny)
    del hparams["optimizer"], hparams["scheduler"]
    if layout == "nested-hparams":
        hparams = {"hparams": hparams}
    save_file(reference_tiny.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hparams))
    source = tmp_path / "model.safetensors" if layout == "safetensors-file" else tmp_path
    nv_model = convert_encodon_checkpoint_to_te(*load_encodon_checkpoint(source), backend="torch")
    assert same_logits(nv_model, reference_tiny)


def test_missing_checkpoint_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Encodon checkpoint at"):
        load_encodon_checkpoint(tmp_path / "nothing.ckpt")
    with pytest.raises(FileNotFoundError, match="needs model.safetensors .or pytorch_model.bin. and config.json"):
        load_encodon_checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------------------- errors


def test_missing_extra_and_misshapen_weights_are_named(reference_tiny):
    state, hparams = reference_tiny.state_dict(), hyper_parameters(reference_tiny)
    del state["layers.1.output_dense.bias"]
    state["layers.2.attention.query.weight"] = torch.zeros(64, 64)  # a third layer the hparams do not have
    state["layers.0.intermediate_dense.weight"] = torch.zeros(10, 64)
    with pytest.raises(ValueError) as error:
        convert_encodon_checkpoint_to_te(state, hparams, backend="torch")
    message = str(error.value)
    assert "missing keys (1): ['layers.1.output_dense.bias']" in message
    assert "unexpected keys (1): ['layers.2.attention.query.weight']" in message
    assert "layers.0.intermediate_dense.weight: checkpoint (10, 64) vs config (128, 64)" in message


def test_a_rotary_table_of_another_theta_is_refused(reference_tiny):
    """The stored inv_freq says theta 1e5 (EnCodonConfig's own default) while the hparams say 1e4: refuse, by name."""
    trained_with_1e5 = reference_model(rotary_theta=1e5)
    hparams = {**hyper_parameters(trained_with_1e5), "rotary_theta": 1e4}
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.attention\.rotary_emb\.inv_freq is not the rotary table of rotary_theta=10000\.0",
    ):
        convert_encodon_checkpoint_to_te(trained_with_1e5.state_dict(), hparams, backend="torch")
    model = convert_encodon_checkpoint_to_te(
        trained_with_1e5.state_dict(), hyper_parameters(trained_with_1e5), backend="torch"
    )
    assert model.config.rotary_theta == 1e5 and same_logits(model, trained_with_1e5)


def test_downstream_heads_and_lora_are_refused(reference_tiny):
    for setting in ("use_downstream_head", "lora"):
        hparams = {**hyper_parameters(reference_tiny), setting: True}
        with pytest.raises(ValueError, match="cross-attention downstream head or LoRA adapters"):
            convert_encodon_checkpoint_to_te(reference_tiny.state_dict(), hparams, backend="torch")


def test_missing_hparams_take_encodon_pl_defaults(reference_tiny):
    """EncodonPL builds 768 wide when hyper_parameters leave hidden_size out; so does the conversion (and the weights
    then say what is wrong)."""
    hparams = hyper_parameters(reference_tiny)
    del hparams["hidden_size"]
    with pytest.raises(ValueError, match="hidden 768"):
        convert_encodon_checkpoint_to_te(reference_tiny.state_dict(), hparams, backend="torch")


def test_conversion_keeps_the_checkpoint_dtype(reference_tiny):
    reference = reference_tiny.to(torch.bfloat16)
    nv_model = convert_encodon_checkpoint_to_te(reference.state_dict(), hyper_parameters(reference), backend="torch")
    assert all(p.dtype == torch.bfloat16 for p in nv_model.parameters())
    back, _ = convert_encodon_te_to_checkpoint(nv_model)
    for key, value in reference.state_dict().items():
        if not key.endswith("inv_freq"):  # written in float32 (the published buffer's dtype), compared above
            assert torch.equal(back[f"model.{key}"], value), key


# ------------------------------------------------------------------------------------------------------------ CLI


def test_export_cli_from_a_lightning_checkpoint_and_back(tmp_path, reference_tiny, capsys):
    path = lightning_checkpoint(reference_tiny, tmp_path / "last.ckpt")
    with pytest.raises(SystemExit) as refused:
        export_main(["--source", str(path), "--output-dir", str(tmp_path / "te")])
    assert refused.value.code == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert len(error_lines) == 1 and error_lines[0].startswith("error: ") and "--trust-checkpoint" in error_lines[0]
    assert not (tmp_path / "te").exists()

    export_main(["--source", str(path), "--output-dir", str(tmp_path / "te"), "--trust-checkpoint"])
    nv_model = NVEncodonForMaskedLM.from_pretrained(tmp_path / "te", backend="torch")
    assert same_logits(nv_model, reference_tiny)
    export_main(["--to-checkpoint", "--source", str(tmp_path / "te"), "--output-dir", str(tmp_path / "again")])
    assert f"wrote {tmp_path / 'again' / 'model.ckpt'}" in capsys.readouterr().out
    checkpoint = torch.load(tmp_path / "again" / "model.ckpt", weights_only=True)
    for key, value in reference_tiny.state_dict().items():
        assert torch.equal(checkpoint["state_dict"][f"model.{key}"], value), key
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["model.ckpt"]


def test_export_of_a_bf16_request_holds_bf16_weights(tmp_path, reference_tiny):
    reference_tiny.save_pretrained(tmp_path / "published")
    export_main(["--source", str(tmp_path / "published"), "--output-dir", str(tmp_path / "te"), "--dtype", "bfloat16"])
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "te" / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "te" / "config.json").read_text())["model_type"] == "bert"
