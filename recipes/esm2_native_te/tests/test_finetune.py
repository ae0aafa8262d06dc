"""Fine-tuning: init_from_pretrained loads a stock Hugging Face ESM-2 checkpoint (converted on the fly) or an NVEsm
export. With a learning rate of 0, training must leave the weights exactly as loaded, so the final export equals
the pretrained checkpoint's weights — under DDP (whole model) and FSDP2 (every rank loads its shards)."""

import pytest
import torch
from convert import convert_esm_hf_to_te
from launch import run_script
from test_train import FAST, load_export


NO_LEARNING = ["num_train_steps=2", "adamw_kwargs.lr=0.0", "logger.log_every=1", "checkpoint.save_every=0"]


@pytest.mark.parametrize(("script", "nproc"), [("train_ddp.py", None), ("train_fsdp2.py", 2)])
def test_finetune_from_stock_checkpoint_keeps_its_weights(tmp_path, stock_checkpoint, script, nproc):
    """Converted on load; with lr=0 the export holds the stock weights exactly (FSDP2: loaded per shard)."""
    path, hf_model = stock_checkpoint
    run_script(
        script, f"output_dir={tmp_path}", f"model_tag={path}", "init_from_pretrained=true", *FAST, *NO_LEARNING,
        nproc=nproc,
    )  # fmt: skip
    expected = convert_esm_hf_to_te(hf_model, backend="torch").state_dict()
    assert_export_holds(tmp_path, expected, "NVEsmForMaskedLM")

    # ... and the NVEsm export is a model_tag in its turn (our own layout, not the stock one): same weights again.
    # Once: reading an export differs from reading the stock checkpoint in the family's reader, not in the sharding.
    if script != "train_ddp.py":
        return
    again = tmp_path / "from_export"
    run_script(
        script, f"output_dir={again}", f"model_tag={tmp_path / 'final_model'}", "init_from_pretrained=true", *FAST,
        *NO_LEARNING, nproc=nproc,
    )  # fmt: skip
    assert_export_holds(again, expected, "NVEsmForMaskedLM")


def assert_export_holds(output_dir, expected: dict[str, torch.Tensor], architecture: str) -> None:
    """The run's export has exactly the ``expected`` weights, under our class name (not FSDP2's wrapper class)."""
    exported_model = load_export(output_dir)
    assert exported_model.config.architectures == [architecture]
    exported = exported_model.state_dict()
    for key, value in expected.items():
        if not key.endswith("_extra_state"):
            assert torch.equal(exported[key], value), key


def test_init_from_pretrained_rejects_other_architectures(tmp_path):
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "bert"}')
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path / 'run'}", f"model_tag={other}", *NO_LEARNING, expect_failure=True
    )
    assert "holds a 'bert' model, not ESM-2" in result.stderr + result.stdout
