"""Fixtures and checks shared by the CPU and GPU tests: a tiny stock ESM-2 checkpoint, a tiny AMPLIFY checkpoint in the
published layout, and what a fine-tuned export with lr 0 must hold."""

import json
from pathlib import Path

import pytest
import torch
from convert_amplify import convert_amplify_te_to_hf
from modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForMaskedLM, EsmConfig, EsmForMaskedLM


# lr 0 (and no warm-up, so no step sees another rate): two optimizer steps that leave every weight as it was loaded.
NO_LEARNING = ["adamw_kwargs.lr=0.0", "lr_scheduler_kwargs.num_warmup_steps=0", "num_train_steps=2"]
MISSING_WEIGHT = "transformer_encoder.1.ffn.w3.weight"


def save_stock_esm2(path: Path) -> EsmForMaskedLM:
    """A tiny stock Hugging Face ``EsmForMaskedLM`` (random weights, seed 0) saved with ``save_pretrained`` at ``path``."""
    torch.manual_seed(0)
    stock_config = EsmConfig(
        vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=1026, position_embedding_type="rotary", pad_token_id=1, mask_token_id=32,
        token_dropout=True, emb_layer_norm_before=False,
    )  # fmt: skip
    stock = EsmForMaskedLM(stock_config).eval()
    stock.save_pretrained(path)
    return stock


@pytest.fixture(scope="module")
def published_amplify(tmp_path_factory):
    """A tiny AMPLIFY in the published layout (chandar-lab's keys in model.safetensors, config.json with
    ``model_type: AMPLIFY``), written by this recipe's converter from a random NVAmplify model. Returns the directory,
    the published state dict and config, and the NV model's own weights: what a load must give back exactly."""
    torch.manual_seed(5)
    model = NVAmplifyForMaskedLM(
        NVAmplifyConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, backend="torch"
        )
    )
    with torch.no_grad():
        model.decoder.bias.normal_()  # zero at init: make it something a wrong load could not reproduce
        # The published layout has no vocabulary padding and the load pads with zeros: zero the padding here too, so
        # that the NV model's weights are the reference for every row.
        for padded in (model.amplify.embeddings.weight, model.decoder.weight, model.decoder.bias):
            padded[model.config.vocab_size :] = 0
    state_dict, config = convert_amplify_te_to_hf(model)
    assert config["model_type"] == "AMPLIFY" and "encoder.weight" in state_dict and MISSING_WEIGHT in state_dict
    path = tmp_path_factory.mktemp("published") / "AMPLIFY_tiny"
    path.mkdir()
    save_file(state_dict, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    expected = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return path, state_dict, config, expected


def assert_export_holds(run: Path, expected: dict[str, torch.Tensor]) -> None:
    """``run``'s export is an NVAmplify directory whose weights are exactly ``expected``, key for key, and it loads
    with AutoModelForMaskedLM (trust_remote_code) holding them."""
    export_dir = run / "final_model"
    assert json.loads((export_dir / "config.json").read_text())["architectures"] == ["NVAmplifyForMaskedLM"]
    exported = load_file(export_dir / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True, backend="torch")
    loaded = AutoModelForMaskedLM.from_pretrained(export_dir, config=config, trust_remote_code=True).state_dict()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
