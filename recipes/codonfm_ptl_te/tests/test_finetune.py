"""Fine-tuning (data.task regression | classification): the head learns a synthetic per-sequence label, and the encoder
starts from a pre-training export or Lightning checkpoint, weight for weight."""

import json

import numpy as np
import pyarrow.csv as pa_csv
import pytest
import torch
from launch import RECIPE_DIR, run_script
from modeling_codonfm_te import NVEncodonConfig, NVEncodonForMaskedLM
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification


L0_SHAPE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_l0_finetune_learns_gc3(tmp_path):
    """The shipped L0_finetune config: the validation MSE ends far below the label's variance (the MSE of always
    predicting the mean), and predictions correlate with the label."""
    labels = np.asarray(pa_csv.read_csv(RECIPE_DIR / "data" / "finetune_sanity.csv").column("label"), dtype=float)
    run_script("train.py", "--config-name", "L0_finetune", f"output_dir={tmp_path}", timeout=300)
    final = read_jsonl(tmp_path / "val_metrics.jsonl")[-1]
    assert final["step"] == 150
    assert final["val_mse"] < 0.05 * labels.var(), (final, labels.var())
    assert final["val_pearson"] > 0.95
    config = AutoConfig.from_pretrained(tmp_path / "final_model", trust_remote_code=True, backend="torch")
    assert config.architectures == ["NVEncodonForSequenceClassification"] and config.problem_type == "regression"
    model = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "final_model", config=config, trust_remote_code=True
    )
    assert model.classifier.out_proj.out_features == 1


def test_classification_head_learns_a_class_label(tmp_path):
    """GC3 above or below 0.5 as two classes (data.task=classification, cross-entropy): accuracy well above chance."""
    table = pa_csv.read_csv(RECIPE_DIR / "data" / "finetune_sanity.csv")
    classes = (np.asarray(table.column("label")) > 0.5).astype(int)
    path = tmp_path / "classes.csv"
    path.write_text(
        "sequence,label\n" + "".join(f"{s},{c}\n" for s, c in zip(table.column("sequence").to_pylist(), classes))
    )
    run_script(
        "train.py", "--config-name", "L0_finetune", f"output_dir={tmp_path / 'run'}", f"data.train_path={path}",
        "data.task=classification", "data.num_classes=2", "num_train_steps=60", "trainer.val_check_interval=60",
        "export_final_model=false",
    )  # fmt: skip
    final = read_jsonl(tmp_path / "run" / "val_metrics.jsonl")[-1]
    assert final["val_accuracy"] > 0.85, final


def write_pretrained(tmp_path):
    """A pre-trained model of the L0 shape (random weights), as an export directory and as a Lightning checkpoint."""
    from hf_export import write_hf_directory

    torch.manual_seed(1)
    config = NVEncodonConfig.from_pretrained(RECIPE_DIR / "model_configs" / "encodon_80m", backend="torch", **L0_SHAPE)
    model = NVEncodonForMaskedLM(config)
    write_hf_directory(model, tmp_path / "export")
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "model_config": config.to_dict()}, tmp_path / "pretrain.ckpt")
    return model.state_dict()


@pytest.mark.parametrize("source", ["export", "pretrain.ckpt"])
def test_finetuning_starts_from_the_pretrained_encoder(tmp_path, source):
    """finetune.init_from with a learning rate of 0: the exported classifier's encoder is the pre-trained encoder,
    exactly; its head is new (the MLM head is left behind)."""
    pretrained = write_pretrained(tmp_path)
    run_script(
        "train.py", "--config-name", "L0_finetune", f"output_dir={tmp_path / 'run'}",
        f"finetune.init_from={tmp_path / source}", "adamw_kwargs.lr=0.0", "num_train_steps=2",
        "trainer.val_check_interval=1000",
    )  # fmt: skip
    exported = load_file(tmp_path / "run" / "final_model" / "model.safetensors")
    encoder = {k: v for k, v in pretrained.items() if k.startswith("encodon.") and not k.endswith("_extra_state")}
    assert encoder and all(key in exported for key in encoder)
    for key, value in encoder.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)
    assert not any(key.startswith("lm_head.") for key in exported) and "classifier.out_proj.weight" in exported


def test_a_pretrained_model_of_another_shape_is_refused(tmp_path):
    write_pretrained(tmp_path)
    result = run_script(
        "train.py", "--config-name", "L0_finetune", f"output_dir={tmp_path / 'run'}",
        f"finetune.init_from={tmp_path / 'export'}", "model_config_overrides.hidden_size=64", expect_failure=True,
    )  # fmt: skip
    assert result.returncode == 2 and "does not fit this model" in result.stderr
