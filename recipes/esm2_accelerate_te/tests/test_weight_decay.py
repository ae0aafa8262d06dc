"""The Trainer's AdamW decays the recipe's model as it decays the stock Hugging Face ESM-2: the weight matrices and the
embedding table, not the biases and LayerNorm weights, whatever TE calls them (``MaskedLMTrainer.
get_decay_parameter_names``). The Trainer's own rule goes by name and skipped TE's ``layernorm_qkv.weight``,
``fc1_weight`` and ``fc2_weight``.

References: the Trainer's own rule on the stock model (``Trainer.get_decay_parameter_names``), carried over to the
recipe's model through convert.py; and a launch in which only weight decay can move a weight."""

from types import SimpleNamespace

import torch
from accelerate_run import FAST, TINY_ESM2, accelerate_launch, read_metrics, refusal_line
from conftest import save_stock_esm2
from convert import convert_esm_hf_to_te
from mlm_trainer import MaskedLMTrainer
from safetensors.torch import load_file
from transformers import Trainer


def _recipe_rule(model: torch.nn.Module) -> set[str]:
    trainer = SimpleNamespace(args=SimpleNamespace(weight_decay=0.01))  # the method reads only the rate (its log)
    return set(MaskedLMTrainer.get_decay_parameter_names(trainer, model))


def test_the_recipe_model_decays_what_the_trainer_decays_on_the_stock_model(tmp_path):
    stock = save_stock_esm2(tmp_path)
    # The Trainer's rule lists a tied tensor under both names; its optimizer groups go by named_parameters (one name).
    trainer_rule = set(Trainer.get_decay_parameter_names(None, stock)) & dict(stock.named_parameters()).keys()
    # On the stock model the recipe's rule is the Trainer's.
    assert _recipe_rule(stock) == trainer_rule
    # Mark what the Trainer decays on the stock model (ones) and what it does not (zeros), then convert: each of the
    # recipe model's tensors carries the marks of the stock tensors it was made from (QKV fused, vocabulary padded).
    with torch.no_grad():
        for name, param in stock.named_parameters():
            param.fill_(1.0 if name in trainer_rule else 0.0)
    converted = convert_esm_hf_to_te(stock, backend="torch")
    decayed = _recipe_rule(converted)
    for name, param in converted.named_parameters():
        assert (name in decayed) == bool(param.any()), name
    # What the Trainer's name rule would have done with TE's names: most of each layer's weight matrices undecayed.
    by_name = set(Trainer.get_decay_parameter_names(None, converted)) & dict(converted.named_parameters()).keys()
    missed = sorted(decayed - by_name)
    assert "esm.encoder.layers.0.self_attention.layernorm_qkv.weight" in missed
    assert "esm.encoder.layers.0.layernorm_mlp.fc1_weight" in missed


COMMON = [
    TINY_ESM2, *FAST, "num_train_steps=2", "logger.log_every=1", "lr_scheduler_kwargs.num_warmup_steps=1",
    "export_final_model=false", "checkpoint.save_every=1",
]  # fmt: skip


def test_one_step_of_weight_decay_shrinks_the_weight_matrices_only(tmp_path):
    """Step 1 trains; step 2, resumed with eps 1e10 (Adam's update ~1e-10 of a step) and weight decay 1, moves each
    decayed weight by ``-lr * weight`` and nothing else: the weight matrices and the embedding table come out times
    ``1 - lr``, the biases and LayerNorm weights as they were. On the code before, TE's fused QKV and MLP weights kept
    their values."""
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *COMMON, "stop_after_steps=1")
    accelerate_launch(
        "cpu.yaml", f"output_dir={tmp_path}", *COMMON, "adamw_kwargs.eps=1e10", "adamw_kwargs.weight_decay=1.0"
    )
    lr = read_metrics(tmp_path)[-1]["lr"]
    assert read_metrics(tmp_path)[-1]["step"] == 2 and lr > 1e-4
    before = load_file(tmp_path / "checkpoint-1" / "model.safetensors")
    after = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert before.keys() == after.keys()
    shrunk, kept = [], []
    for name, weight in before.items():
        if weight.ndim >= 2:
            torch.testing.assert_close(after[name], weight * (1 - lr), rtol=1e-5, atol=1e-8, msg=name)
            shrunk.append(name)
        else:
            torch.testing.assert_close(after[name], weight, rtol=1e-5, atol=1e-8, msg=name)
            kept.append(name)
    assert any(name.endswith("layernorm_qkv.weight") for name in shrunk)
    assert any(name.endswith("layer_norm_weight") for name in kept) and any(name.endswith("bias") for name in kept)


def test_a_checkpoint_with_other_optimizer_groups_is_refused_in_one_line(tmp_path):
    """An AdamW state whose groups do not fit the recipe's (a checkpoint of the Trainer's name rule: other group sizes)
    ends the resume with one line that says what to do, not torch's traceback."""
    accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *COMMON, "stop_after_steps=1")
    state_path = tmp_path / "checkpoint-1" / "optimizer.pt"
    state = torch.load(state_path, weights_only=False)
    decayed, undecayed = state["param_groups"][0]["params"], state["param_groups"][1]["params"]
    undecayed.append(decayed.pop())  # one weight matrix in the undecayed group, as the name rule had it
    torch.save(state, state_path)
    result = accelerate_launch("cpu.yaml", f"output_dir={tmp_path}", *COMMON, expect_failure=True)
    assert "other parameter groups than this recipe builds" in refusal_line(result)
    assert 'mlm_trainer.py", line' not in result.stderr, result.stderr[-3000:]  # no traceback from the recipe
    assert not (tmp_path / "checkpoint-2").exists()
