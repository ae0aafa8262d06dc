# Copied from common/tests/model_contract_export.py — edit the source, then run ci/check_copies.py --fix
"""The model contract's export part: what ``hf_export`` writes (files, config, weights) and that the directory
loads as a user loads it, offline, in a fresh process, with and without ``trust_remote_code``.

Imported into a model's ``tests/test_model_contract.py`` next to ``model_contract`` (``from model_contract_export
import *``), against the same ``contract`` fixture; model_contract.py checks that every part is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from model_contract import ModelContract, is_tied, max_abs_difference, supports_recompute
from safetensors import safe_open
from transformers import AutoModel, AutoTokenizer, PreTrainedModel


def export_stock_model(contract: ModelContract, tmp_path: Path) -> tuple[PreTrainedModel, Path]:
    hf_model = contract.hf_model()
    hf_model.save_pretrained(tmp_path / "hf")
    out = contract.export(tmp_path / "hf", tmp_path / "exported")
    assert Path(out) == tmp_path / "exported"
    return hf_model, Path(out)


def test_export_writes_a_complete_directory(contract, tmp_path):
    _, out = export_stock_model(contract, tmp_path)
    names = {p.name for p in out.iterdir()}
    wanted = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md", "LICENSE"}
    assert wanted | set(contract.modeling_files) <= names, sorted(wanted | set(contract.modeling_files) - names)
    # The directory was staged beside the target and renamed: nothing else is left there.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "hf"]


def test_export_ships_every_module_its_auto_map_names(contract, tmp_path, monkeypatch):
    """The configuration file (``AutoConfig``) is shipped beside the modeling file; an ``AUTO_MAP`` entry naming a
    module that is not there is refused with its name (an export without it would not load), and nothing is written."""
    _, out = export_stock_model(contract, tmp_path)
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert {target.split(".")[0] + ".py" for target in auto_map.values()} <= {p.name for p in out.iterdir()}
    assert auto_map["AutoConfig"].startswith("configuration_")
    modeling = sys.modules[contract.nv_class.__module__]
    monkeypatch.setattr(modeling, "AUTO_MAP", {**modeling.AUTO_MAP, "AutoModelForPreTraining": "not_beside_it.Model"})
    with pytest.raises(FileNotFoundError, match=r"AUTO_MAP names modules that are not beside it: .*not_beside_it\.py"):
        contract.export(tmp_path / "hf", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_export_config_and_weights(contract, tmp_path):
    """config.json loads anywhere (auto_map, backend "auto", no quantized layers); the weights are stored once."""
    hf_model, out = export_stock_model(contract, tmp_path)
    config = json.loads((out / "config.json").read_text())
    modeling = sys.modules[contract.nv_class.__module__]
    assert config["auto_map"] == modeling.AUTO_MAP
    module_stem = Path(modeling.__file__).stem
    assert config["auto_map"][contract.auto_class.__name__] == f"{module_stem}.{contract.nv_class.__name__}"
    assert config["architectures"] == [contract.nv_class.__name__]
    assert config["backend"] == "auto"
    assert "layer_precision" in config and config["layer_precision"] is None, config.get("layer_precision")
    with safe_open(out / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    assert not any(key.endswith("_extra_state") for key in keys)
    if hf_model.config.tie_word_embeddings:
        for output_key, input_key in contract.nv_class._tied_weights_keys.items():
            assert len({output_key, input_key} & keys) == 1, f"tied {output_key} / {input_key}: stored {keys}"


def test_export_drops_a_training_precision_plan_and_keeps_the_callers_config(contract, tmp_path):
    """A model trained with FP8 layers exports without them (the export must load on any backend), and the model
    the caller keeps training still has its plan."""
    nv_model = contract.hf_to_nv(contract.hf_model(), backend="torch")
    plan = ["fp8"] * nv_model.config.num_hidden_layers  # set after construction: the torch backend refuses to build it
    nv_model.config.layer_precision = plan
    if supports_recompute(contract):  # a memory setting of the run: the export does not keep it either
        nv_model.config.recompute_layers = 1
    out = contract.save_nv(nv_model, tmp_path / "exported")
    exported_config = json.loads((Path(out) / "config.json").read_text())
    assert exported_config["layer_precision"] is None
    assert exported_config.get("recompute_layers", 0) == 0
    assert nv_model.config.layer_precision == plan and nv_model.config.backend == "torch"
    assert nv_model.config.to_dict().get("recompute_layers", 1) == 1
    reloaded = contract.auto_class.from_pretrained(out, trust_remote_code=True, backend="torch")
    assert reloaded.config.layer_precision is None


def test_export_loads_offline_and_matches_the_stock_model(contract, tmp_path, monkeypatch):
    hf_model, out = export_stock_model(contract, tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import, so patch it too
    # backend="torch" overrides the exported "auto", so this CPU comparison holds on GPU machines too.
    model = contract.auto_class.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    assert type(model).__name__ == contract.nv_class.__name__ and model.backend == "torch"
    assert type(model).__module__ != contract.nv_class.__module__  # the directory's code, not the package's
    assert is_tied(model) == hf_model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = dict(tokenizer(list(contract.tokenizer_texts), return_tensors="pt", padding=True))
    batch.pop("token_type_ids", None)
    real = batch["attention_mask"].bool()
    assert not real.all(), "the texts should be of different lengths, so that the batch has padding"
    with torch.no_grad():
        expected, actual = hf_model(**batch).logits, model(**batch).logits
    assert max_abs_difference(actual[real], expected[real]) <= contract.tolerance

    base = AutoModel.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    with torch.no_grad():
        hidden = base(**batch).last_hidden_state
        expected_hidden = hf_model.base_model(**batch).last_hidden_state
    assert max_abs_difference(hidden[real], expected_hidden[real]) <= contract.tolerance

    # Converted back, the export is the stock model again, tensor for tensor.
    stock = contract.nv_to_hf(model).state_dict()
    for key, value in hf_model.state_dict().items():
        assert torch.equal(stock[key], value), key


# What a user types in a fresh interpreter: the tokenizer without trust_remote_code, then the model.
LOAD_AS_A_USER = """
import sys
import transformers
from transformers import AutoTokenizer

path, auto_class, trust, texts = sys.argv[1], getattr(transformers, sys.argv[2]), sys.argv[3] == "trust", sys.argv[4:]
tokenizer = AutoTokenizer.from_pretrained(path)
model = auto_class.from_pretrained(path, trust_remote_code=True) if trust else auto_class.from_pretrained(path)
batch = tokenizer(texts, return_tensors="pt", padding=True)
batch.pop("token_type_ids", None)
print(type(model).__name__, tuple(model(**batch).logits.shape))
"""


def load_as_a_user(contract: ModelContract, export_dir: Path, trust_remote_code: bool) -> subprocess.CompletedProcess:
    """Run LOAD_AS_A_USER as a batch job would: stdin closed, no network, no GPU, none of the tests' paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    env.update({"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})  # the CPU load; the TE one is a GPU test
    trust = "trust" if trust_remote_code else "no-trust"
    command = [sys.executable, "-c", LOAD_AS_A_USER, str(export_dir), contract.auto_class.__name__, trust]
    return subprocess.run(
        [*command, *contract.tokenizer_texts],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=export_dir.parent,
    )


def test_export_loads_in_a_fresh_process_without_prompts_or_warnings(contract, tmp_path):
    """The README's two lines load the export in a batch job, and print nothing on the way: no "Do you wish to run
    the custom code?" prompt for the tokenizer, no model-type warning for the model."""
    _, out = export_stock_model(contract, tmp_path)
    result = load_as_a_user(contract, out, trust_remote_code=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(contract.nv_class.__name__), result.stdout
    # transformers' own "Loading weights" progress bar is the one thing allowed on stderr.
    printed = [line for line in result.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert not printed, "loading printed:\n" + "\n".join(printed)


def test_export_without_trust_remote_code_is_never_silently_the_stock_model(contract, tmp_path):
    """config.json says the stock model type (so tokenizers load without custom code). Without trust_remote_code,
    transformers builds its own class, which cannot read the fused layers: the load fails (a size mismatch) or
    reports the weights it could not load; it never passes quietly for the trained model."""
    _, out = export_stock_model(contract, tmp_path)
    result = load_as_a_user(contract, out, trust_remote_code=False)
    assert "LOAD REPORT" in result.stderr and ("MISSING" in result.stderr or "MISMATCH" in result.stderr), (
        result.stderr
    )


# What ``from model_contract_export import *`` brings into a model's test module: its tests.
__all__ = [name for name in list(globals()) if name.startswith("test_")]
