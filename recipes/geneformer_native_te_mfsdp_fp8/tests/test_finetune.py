"""Fine-tuning: init_from_pretrained loads a stock Hugging Face BertForMaskedLM with Geneformer's settings (the layout
of the published Geneformer checkpoints, converted on the fly) or an export of this recipe. With a learning rate of
0, training must leave the weights exactly as loaded, so the final export equals the pretrained weights, under DDP
(whole model) and FSDP2 (every rank loads its shards)."""

import pytest
import torch
from convert import convert_geneformer_hf_to_te
from launch import run_script
from test_train import FAST, load_export


NO_LEARNING = ["num_train_steps=2", "adamw_kwargs.lr=0.0", "logger.log_every=1", "dataset.num_workers=0"]
# The 10m config: no model_config_overrides (L0_sanity's narrow the model, and the pretrained weights fix the shape).
FINETUNE = ["--config-name", "10m", "dataset.path=data/sanity_cells.parquet", *FAST, *NO_LEARNING]


def assert_export_holds(output_dir, expected: dict[str, torch.Tensor]) -> None:
    """The run's export has exactly the ``expected`` weights, under our class name (not FSDP2's wrapper class)."""
    exported_model = load_export(output_dir)
    assert exported_model.config.architectures == ["NVGeneformerForMaskedLM"]
    exported = exported_model.state_dict()
    for key, value in expected.items():
        if not key.endswith("_extra_state"):
            assert torch.equal(exported[key], value), key


@pytest.mark.parametrize(("script", "nproc"), [("train_ddp.py", None), ("train_fsdp2.py", 2)])
def test_finetune_from_a_published_layout_checkpoint_keeps_its_weights(tmp_path, stock_checkpoint, script, nproc):
    path, hf_model = stock_checkpoint
    run_script(
        script, *FINETUNE, f"output_dir={tmp_path}", f"model_tag={path}", "init_from_pretrained=true", nproc=nproc
    )
    assert_export_holds(tmp_path, convert_geneformer_hf_to_te(hf_model, backend="torch").state_dict())


def test_finetune_from_an_export_of_this_recipe(tmp_path, stock_checkpoint):
    path, hf_model = stock_checkpoint
    first = [f"output_dir={tmp_path / 'first'}", f"model_tag={path}", "init_from_pretrained=true"]
    run_script("train_ddp.py", *FINETUNE, *first)
    export = tmp_path / "first" / "final_model"
    second = [f"output_dir={tmp_path / 'second'}", f"model_tag={export}", "init_from_pretrained=true"]
    run_script("train_fsdp2.py", *FINETUNE, *second, nproc=2)
    assert_export_holds(tmp_path / "second", convert_geneformer_hf_to_te(hf_model, backend="torch").state_dict())


def test_init_from_pretrained_rejects_other_architectures(tmp_path):
    other = tmp_path / "esm"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "esm"}')
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path / 'run'}", f"model_tag={other}", *NO_LEARNING, expect_failure=True
    )
    assert "holds a 'esm' model, not Geneformer" in result.stderr + result.stdout
