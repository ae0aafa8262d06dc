"""Fine-tuning: init_from_pretrained loads a stock Hugging Face ViTForImageClassification (converted on load) or an
export of this recipe. With a learning rate of 0, training must leave the weights exactly as loaded, so the export
equals the pretrained weights: under DDP (the whole model) and FSDP2 (every rank copies in its own shards). A
classifier for another number of classes is replaced by a new one and everything else is still loaded."""

import pytest
import torch
from conftest import stock_vit
from convert import convert_vit_hf_to_te
from launch import run_script
from test_train import load_export


# lr 0 (weight decay then multiplies by exactly 1): two steps that leave every weight as it was loaded.
NO_LEARNING = [
    "num_train_steps=2", "adamw_kwargs.lr=0.0", "lr_scheduler_kwargs.num_warmup_steps=0", "logger.log_every=1",
    "validation.every_n_steps=0", "dataset.num_workers=0",
]  # fmt: skip


def finetune(script: str, output_dir, images, model_tag, *overrides: str, nproc=None, **kwargs):
    return run_script(
        script, f"output_dir={output_dir}", f"dataset.path={images}", f"model_tag={model_tag}",
        "init_from_pretrained=true", *NO_LEARNING, *overrides, nproc=nproc, timeout=600, **kwargs,
    )  # fmt: skip


def assert_export_holds(output_dir, expected: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    """The run's export holds exactly the ``expected`` weights (but ``skip``), under our class name."""
    exported_model = load_export(output_dir / "final_model")
    assert exported_model.config.architectures == ["NVViTForImageClassification"]
    exported = exported_model.state_dict()
    for key, value in expected.items():
        if not key.endswith("_extra_state") and key not in skip:
            assert torch.equal(exported[key], value), key


@pytest.mark.parametrize(("script", "nproc"), [("train_ddp.py", None), ("train_fsdp2.py", 2)])
def test_finetune_from_a_stock_checkpoint_and_from_its_export(tmp_path, images, stock_checkpoint, script, nproc):
    path, hf_model = stock_checkpoint
    expected = convert_vit_hf_to_te(hf_model, backend="torch").state_dict()
    finetune(script, tmp_path / "from_stock", images, path, nproc=nproc)
    assert_export_holds(tmp_path / "from_stock", expected)
    finetune(script, tmp_path / "from_export", images, tmp_path / "from_stock" / "final_model", nproc=nproc)
    assert_export_holds(tmp_path / "from_export", expected)


@pytest.mark.parametrize(("script", "nproc"), [("train_ddp.py", None), ("train_fsdp2.py", 2)])
def test_a_classifier_for_other_classes_is_replaced_and_the_rest_loaded(tmp_path, images, script, nproc):
    """A 10-class checkpoint on the 4-class L0 set: the export has a new 4-class classifier and every other weight of
    the checkpoint, exactly; the log says the classifier was replaced."""
    hf_model = stock_vit(10, tmp_path / "stock10")
    result = finetune(script, tmp_path / "run", images, tmp_path / "stock10", nproc=nproc)
    classifier = ("classifier.weight", "classifier.bias")
    assert_export_holds(tmp_path / "run", convert_vit_hf_to_te(hf_model, backend="torch").state_dict(), classifier)
    exported = load_export(tmp_path / "run" / "final_model")
    assert exported.classifier.weight.shape == (4, 64) and exported.config.num_labels == 4
    assert "with a new classifier: 4 classes in the data, 10 in the checkpoint" in result.stdout + result.stderr
