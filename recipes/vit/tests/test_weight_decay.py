"""weight_decay.py: AdamW decays the ViT's weight matrices and nothing else (no bias, LayerNorm weight, class token or
position embedding: DeiT's and timm's rule), under every strategy.

References: the L0 model's parameter names written out by hand, and what weight decay alone does to a weight: one
AdamW step on zero gradients multiplies a decayed weight by exactly ``1 - lr * weight_decay`` and leaves an undecayed
one as it was.
"""

from pathlib import Path

import pytest
import torch
from adamw import build_adamw, megatron_fsdp_init_step_left_out
from launch import run_script
from modeling_vit_te import NVViTConfig, NVViTForImageClassification
from omegaconf import OmegaConf
from weight_decay import no_weight_decay_names, restore_weight_decay_groups, weight_decay_groups


RECIPE_DIR = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
LR, WEIGHT_DECAY = 0.1, 0.5  # one step of decay multiplies a weight by 0.95

# The L0 model (model_configs/vit-l0-tiny: 4 layers), parameter by parameter. TE's and the torch backend's names are
# the same (models/vit's tests pin them together).
LAYER_DECAYED = (
    "self_attention.layernorm_qkv.weight",
    "self_attention.proj.weight",
    "layernorm_mlp.fc1_weight",
    "layernorm_mlp.fc2_weight",
)
LAYER_NOT_DECAYED = (
    "self_attention.layernorm_qkv.layer_norm_weight",  # the LayerNorm TE fuses into the QKV projection
    "self_attention.layernorm_qkv.layer_norm_bias",
    "self_attention.layernorm_qkv.bias",
    "self_attention.proj.bias",
    "layernorm_mlp.layer_norm_weight",  # and into the MLP
    "layernorm_mlp.layer_norm_bias",
    "layernorm_mlp.fc1_bias",
    "layernorm_mlp.fc2_bias",
)
LAYERS = [f"vit.encoder.layers.{i}." for i in range(4)]
DECAYED = {"vit.embeddings.patch_embeddings.projection.weight", "classifier.weight"} | {
    layer + name for layer in LAYERS for name in LAYER_DECAYED
}
NOT_DECAYED = {
    "vit.embeddings.cls_token",
    "vit.embeddings.position_embeddings",
    "vit.embeddings.patch_embeddings.projection.bias",
    "vit.layernorm.weight",
    "vit.layernorm.bias",
    "classifier.bias",
} | {layer + name for layer in LAYERS for name in LAYER_NOT_DECAYED}


def l0_model() -> NVViTForImageClassification:
    """The L0 model with every parameter random and non-zero (biases start at 0, LayerNorm weights at 1, which would
    hide a decayed bias), so that any decay shows."""
    config = NVViTConfig.from_pretrained(RECIPE_DIR / "model_configs" / "vit-l0-tiny", backend="torch")
    torch.manual_seed(0)
    model = NVViTForImageClassification(config)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(0.5, 1.5)
    return model


def config(fp32_master_weights: bool = True):
    return OmegaConf.create(
        {
            "adamw_kwargs": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WEIGHT_DECAY},
            "mixed_precision": {
                "enabled": True,
                "on_cpu": True,
                "fp32_master_weights": fp32_master_weights,
                "compensate_bf16_updates": True,
            },
        }
    )


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[float, list[str]]]:
    names = {id(param): name for name, param in model.named_parameters()}
    return [(group["weight_decay"], [names[id(p)] for p in group["params"]]) for group in optimizer.param_groups]


def assert_decayed_once(before: dict, after: dict, factor: float, rtol: float = 1e-6) -> None:
    """Every decayed weight multiplied by ``factor`` (to float32 rounding; ``rtol=1e-2`` for bf16 weights), every
    other one exactly as it was."""
    assert set(before) == set(after) == DECAYED | NOT_DECAYED
    for name in NOT_DECAYED:
        assert torch.equal(after[name], before[name]), name
    for name in DECAYED:
        torch.testing.assert_close(after[name], before[name] * factor, rtol=rtol, atol=0, msg=name)
        assert not torch.equal(after[name], before[name]), name


def test_the_groups_hold_every_parameter_once_and_decay_only_the_weight_matrices():
    model = l0_model()
    assert {name for name, _ in model.named_parameters()} == DECAYED | NOT_DECAYED  # the list above is complete
    groups = weight_decay_groups(model, WEIGHT_DECAY)
    assert [group["weight_decay"] for group in groups] == [WEIGHT_DECAY, 0.0]
    ids = [id(param) for group in groups for param in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # each parameter in exactly one group
    names = {id(param): name for name, param in model.named_parameters()}
    assert {names[id(p)] for p in groups[0]["params"]} == DECAYED
    assert {names[id(p)] for p in groups[1]["params"]} == NOT_DECAYED
    # The rule, stated independently: the tensors of one dimension, the class token and the position embeddings.
    one_dimensional = {name for name, param in model.named_parameters() if param.dim() == 1}
    assert one_dimensional | {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"} == NOT_DECAYED
    assert no_weight_decay_names(model) == NOT_DECAYED


@pytest.mark.parametrize("fp32_master_weights", [True, False], ids=["torch-adamw", "compensated-bf16"])
def test_one_step_on_zero_gradients_decays_only_the_weight_matrices(fp32_master_weights):
    """torch's AdamW (fp32 weights on the CPU) and CompensatedAdamW (bf16 weights) honour each group's weight decay.
    (With the decay applied to every parameter, as before, the LayerNorm weights, biases, class token and position
    embeddings would shrink by 5% here.)"""
    model = l0_model()
    if not fp32_master_weights:
        model.to(torch.bfloat16)
    optimizer = build_adamw(weight_decay_groups(model, WEIGHT_DECAY), config(fp32_master_weights), CPU)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    after = {name: param.detach().clone() for name, param in model.named_parameters()}
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY, rtol=1e-6 if fp32_master_weights else 1e-2)


def shard_like_megatron_fsdp(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What ``megatron_fsdp.fully_shard`` (0.6.1) does to a model and its optimizer, without GPUs: every parameter
    replaced by its sharded stand-in under the same name, the optimizer's groups by one new group of those with the
    optimizer's defaults, then a step on zero gradients to build the state."""
    for name, param in list(model.named_parameters()):
        module_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module_name), attribute, torch.nn.Parameter(param.detach().clone()))
    optimizer.param_groups.clear()
    optimizer.state.clear()
    optimizer.add_param_group({"params": list(model.parameters())})
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


def test_groups_are_restored_after_megatron_fsdp_merges_them():
    model = l0_model()
    no_decay = no_weight_decay_names(model)  # named on the model before sharding, as model_setup does
    optimizer = build_adamw(weight_decay_groups(model, WEIGHT_DECAY), config(), CPU)
    with megatron_fsdp_init_step_left_out(optimizer):
        shard_like_megatron_fsdp(model, optimizer)
    assert [decay for decay, _ in group_names(model, optimizer)] == [WEIGHT_DECAY]  # one group: everything decayed

    restore_weight_decay_groups(optimizer, model, no_decay, WEIGHT_DECAY)
    (decay, decayed), (no_decay_value, undecayed) = group_names(model, optimizer)
    assert (decay, set(decayed), no_decay_value, set(undecayed)) == (WEIGHT_DECAY, DECAYED, 0.0, NOT_DECAYED)
    assert all(group["lr"] == LR for group in optimizer.param_groups)  # the learning rate the context restored
    assert all(optimizer.state[p]["step"] == 0 for p in model.parameters())  # the state built at sharding is kept

    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    after = {name: param.detach().clone() for name, param in model.named_parameters()}
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY)


def test_restoring_the_groups_refuses_parameters_it_cannot_name():
    model = l0_model()
    optimizer = build_adamw(weight_decay_groups(model, WEIGHT_DECAY), config(), CPU)
    with pytest.raises(RuntimeError, match="not the model's named parameters"):
        restore_weight_decay_groups(optimizer, l0_model(), no_weight_decay_names(model), WEIGHT_DECAY)


# ------------------------------------------------------------------------------------ as the strategies build it


def zero_gradient_step(tmp_path: Path, strategy: str, *overrides: str, nproc=None, cpu_only=True) -> dict:
    """tests/zero_gradient_step.py: the strategy's own model and optimizer, one step on zero gradients."""
    out = tmp_path / f"{strategy}.pt"
    hyper = [f"adamw_kwargs.lr={LR}", f"adamw_kwargs.weight_decay={WEIGHT_DECAY}"]
    script = RECIPE_DIR / "tests" / "zero_gradient_step.py"
    run_script(script, strategy, str(out), *hyper, *overrides, nproc=nproc, cpu_only=cpu_only, timeout=600)
    return torch.load(out, weights_only=True)


def assert_strategy_decays_only_the_weight_matrices(result: dict, rtol: float = 1e-6) -> None:
    decayed, undecayed = result["groups"]
    assert (decayed["weight_decay"], undecayed["weight_decay"]) == (WEIGHT_DECAY, 0.0)
    assert (set(decayed["names"]), set(undecayed["names"])) == (DECAYED, NOT_DECAYED)
    assert decayed["lr"] == undecayed["lr"] == LR
    weights = [
        {k: v.float() for k, v in result[key].items() if not k.endswith("_extra_state")} for key in ("before", "after")
    ]
    assert_decayed_once(*weights, 1 - LR * WEIGHT_DECAY, rtol)


@pytest.mark.parametrize(("strategy", "nproc"), [("ddp", None), ("fsdp2", 2)], ids=["ddp", "fsdp2-2proc"])
def test_ddp_and_fsdp2_decay_only_the_weight_matrices(tmp_path, strategy, nproc):
    """DDP's whole model; FSDP2's sharded over two processes, its parameters DTensors (named and sized as the whole
    tensors)."""
    assert_strategy_decays_only_the_weight_matrices(zero_gradient_step(tmp_path, strategy, nproc=nproc))
