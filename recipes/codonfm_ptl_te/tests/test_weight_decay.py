"""weight_decay.py in this recipe: AdamW decays Encodon's weight matrices and embedding table and nothing else (no bias,
no LayerNorm weight, none of those TE fuses into LayerNormLinear and LayerNormMLP), as the Hugging Face-style parameter
groups of the published CodonFM training code do, under every strategy: DDP and FSDP2 by the tensors' dimensions,
FSDP1 by their names as built (lightning_module.configure_model records them; model_setup.fsdp1_weight_decay_groups).

References: the L0 model's parameter names written out by hand (with the published EnCodon module each stands for), and
what weight decay alone does to a weight: one AdamW step with an eps so large that Adam's own update vanishes
multiplies a decayed weight by ``1 - lr * weight_decay`` and leaves an undecayed one as it was. train.py is run the way
a user runs it (``tests/test_train_gpu.py`` runs it on a GPU with TE's layers and FSDP1 too).
"""

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from checkpoint_io import check_optimizer_param_groups
from hydra import compose, initialize_config_dir
from launch import RECIPE_DIR, assert_user_error, run_in_process, run_script, snapshot
from lightning.pytorch.strategies import FSDPStrategy
from lightning_module import module_for
from model_setup import FSDP1_WRAPPER_SEGMENTS, fsdp1_weight_decay_groups, name_before_wrapping
from safetensors.torch import load_file
from torch import nn
from user_errors import ConfigError
from weight_decay import weight_decay_groups


LR, WEIGHT_DECAY = 0.05, 1.0  # one step of decay multiplies a weight by 0.95

# The L0 model (2 layers; torch backend on the CPU, TE's layers on a GPU: the same names, models/codonfm's tests pin
# them together), parameter by parameter, with the published EnCodon's module in the comments. The MLM decoder is not
# tied to the embeddings.
LAYER_DECAYED = (
    "self_attention.layernorm_qkv.weight",  # attention.{query,key,value}.weight, fused
    "self_attention.proj.weight",  # post_attn_dense.weight
    "mlp.fc1.weight",  # intermediate_dense.weight
    "mlp.fc2.weight",  # output_dense.weight
)
LAYER_NOT_DECAYED = (
    "self_attention.layernorm_qkv.layer_norm_weight",  # pre_attn_layer_norm, fused into the QKV LayerNormLinear
    "self_attention.layernorm_qkv.layer_norm_bias",
    "self_attention.layernorm_qkv.bias",  # attention.{query,key,value}.bias
    "self_attention.proj.layer_norm_weight",  # post_attn_layer_norm (MAGNETO's Sub-LN), fused into proj
    "self_attention.proj.layer_norm_bias",
    "self_attention.proj.bias",
    "mlp.fc1.layer_norm_weight",  # pre_ffn_layer_norm, fused into fc1
    "mlp.fc1.layer_norm_bias",
    "mlp.fc1.bias",
    "mlp.fc2.layer_norm_weight",  # post_ffn_layer_norm, fused into fc2
    "mlp.fc2.layer_norm_bias",
    "mlp.fc2.bias",
)
LAYERS = [f"encodon.layers.{i}." for i in range(2)]
ENCODER_DECAYED = {"encodon.embeddings.word_embeddings.weight"} | {
    layer + name for layer in LAYERS for name in LAYER_DECAYED
}
ENCODER_NOT_DECAYED = {"encodon.embeddings.layer_norm.weight", "encodon.embeddings.layer_norm.bias"} | {
    layer + name for layer in LAYERS for name in LAYER_NOT_DECAYED
}
DECAYED = ENCODER_DECAYED | {"lm_head.dense.weight", "lm_head.decoder.weight"}  # cls.0, cls.3
NOT_DECAYED = ENCODER_NOT_DECAYED | {
    "lm_head.dense.bias",  # cls.0.bias
    "lm_head.layer_norm.weight",  # cls.2
    "lm_head.layer_norm.bias",
    "lm_head.decoder.bias",  # cls.3.bias
}
# Fine-tuning: the sequence head (dense + out_proj) replaces the MLM head.
HEAD_DECAYED = ENCODER_DECAYED | {"classifier.dense.weight", "classifier.out_proj.weight"}
HEAD_NOT_DECAYED = ENCODER_NOT_DECAYED | {"classifier.dense.bias", "classifier.out_proj.bias"}
GROUPS = {"L0_sanity": (DECAYED, NOT_DECAYED), "L0_finetune": (HEAD_DECAYED, HEAD_NOT_DECAYED)}


def l0_config(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        return compose(
            config_name=name, overrides=["output_dir=unused", f"adamw_kwargs.weight_decay={WEIGHT_DECAY}", *overrides]
        )


def built_module(config_name: str, trainer) -> L.LightningModule:
    """The config's LightningModule with its model built by ``configure_model``, as Lightning does, on the CPU."""
    module = module_for(l0_config(config_name))
    module.trainer = trainer
    module.configure_model()
    return module


def cpu_trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)


def group_names(module: L.LightningModule, optimizer: torch.optim.Optimizer) -> list[tuple[float, set[str]]]:
    """Each group's weight decay and its parameters, by their names before any wrapper."""
    names = {id(param): name_before_wrapping(name) for name, param in module.model.named_parameters()}
    groups = [(group["weight_decay"], [names[id(p)] for p in group["params"]]) for group in optimizer.param_groups]
    assert sum(len(params) for _, params in groups) == len(names)  # each parameter in exactly one group
    return [(decay, set(params)) for decay, params in groups]


@pytest.mark.parametrize("config_name", ["L0_sanity", "L0_finetune"])
def test_the_groups_hold_every_parameter_once_and_decay_only_the_weight_matrices(config_name):
    """configure_optimizers of the pre-training and the fine-tuning module (its sequence head's too), on the CPU's
    torch backend: the weight matrices and the embedding table decayed, every bias and LayerNorm weight not, each
    parameter once. With TE's names the same (the GPU tests)."""
    decayed, undecayed = GROUPS[config_name]
    module = built_module(config_name, cpu_trainer())
    assert module.model.backend == "torch"
    assert {name for name, _ in module.model.named_parameters()} == decayed | undecayed  # the lists are complete
    optimizer = module.configure_optimizers()["optimizer"]
    assert group_names(module, optimizer) == [(WEIGHT_DECAY, decayed), (0.0, undecayed)]
    # The rule, stated independently: the tensors of one dimension, nothing named besides.
    assert {name for name, param in module.model.named_parameters() if param.dim() == 1} == undecayed
    warmup = module.cfg.lr_scheduler_kwargs.num_warmup_steps  # the first step's rate: 1 / warmup of the peak
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(
        [module.cfg.adamw_kwargs.lr / warmup] * 2
    )
    # The settings a resume puts back (optimizer_settings.py) are those of both groups, as built.
    assert [group["weight_decay"] for group in module._configured_optimizer.groups] == [WEIGHT_DECAY, 0.0]


# ------------------------------------------------------------------------------------------------ FSDP1's names


class Wrapper(nn.Module):
    """Stands for FSDP1's ``FullyShardedDataParallel`` or torch's checkpoint wrapper: the module it wraps becomes its
    attribute ``segment``, so every name under it gains that segment."""

    def __init__(self, segment: str, inner: nn.Module):
        super().__init__()
        self.add_module(segment, inner)


def shard_like_fsdp1(unit: nn.Module, parameters: list[tuple[str, nn.Parameter]], rank: int, world: int) -> None:
    """What FSDP1 (``use_orig_params=True``) leaves of ``parameters`` (one FSDP unit's, names relative to ``unit``) on
    ``rank``: each a flat 1-D view of its part of the rank's slice of the unit's concatenated parameters, maybe
    empty."""
    total = sum(param.numel() for _, param in parameters)
    per_rank = math.ceil(total / world)
    low, high = rank * per_rank, min((rank + 1) * per_rank, total)
    offset = 0
    for name, param in parameters:
        start, end = max(low, offset), min(high, offset + param.numel())
        flat = param.detach().flatten()[start - offset : max(start, end) - offset]
        owner, _, attribute = name.rpartition(".")
        setattr(unit.get_submodule(owner), attribute, nn.Parameter(flat.clone()))
        offset += param.numel()


def wrap_like_fsdp1(model: nn.Module, rank: int = 1, world: int = 2) -> None:
    """``model`` as ``configure_optimizers`` sees it under Lightning's FSDPStrategy: each EncodonLayer wrapped by
    FSDP1 and (with activation checkpointing) by the checkpoint wrapper inside it, the rest in the root unit (which
    wraps the LightningModule, so it adds no segment here), every parameter a flat shard of this rank."""
    layers = model.encodon.layers
    root = [(name, param) for name, param in model.named_parameters() if not name.startswith("encodon.layers.")]
    for index, layer in enumerate(layers):
        shard_like_fsdp1(layer, list(layer.named_parameters()), rank, world)
        layers[index] = Wrapper(FSDP1_WRAPPER_SEGMENTS[0], Wrapper(FSDP1_WRAPPER_SEGMENTS[1], layer))
    shard_like_fsdp1(model, root, rank, world)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, only for ``isinstance`` and ``root_device`` (nothing is set up)."""

    root_device = torch.device("cpu")


def test_the_wrapper_segments_are_torchs():
    """The segments stripped from FSDP1's names are exactly those torch inserts."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

    assert FSDP1_WRAPPER_SEGMENTS == (FSDP_WRAPPED_MODULE, _CHECKPOINT_WRAPPED_MODULE)
    name = "encodon.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.fc1.layer_norm_weight"
    assert name_before_wrapping(name) == "encodon.layers.0.mlp.fc1.layer_norm_weight"
    assert name_before_wrapping("lm_head.decoder.bias") == "lm_head.decoder.bias"


@pytest.mark.parametrize("config_name", ["L0_sanity", "L0_finetune"])
def test_under_fsdp1_the_groups_follow_the_names_as_built(config_name, caplog):
    """configure_optimizers after FSDP1 wrapped the model (simulated on the CPU, as rank 1 of 2): every parameter is
    a flat 1-D shard, some empty, so the dimensions would decay nothing; the names recorded by configure_model,
    matched once the wrapper segments are stripped, give the groups of the unwrapped model, and the log line counts
    the whole tensors."""
    decayed, undecayed = GROUPS[config_name]
    module = built_module(config_name, cpu_trainer())
    sizes = {name: param.numel() for name, param in module.model.named_parameters()}
    wrap_like_fsdp1(module.model)
    names = [name for name, _ in module.model.named_parameters()]
    assert all(param.dim() == 1 for param in module.model.parameters())
    assert any(param.numel() == 0 for param in module.model.parameters())
    assert "encodon.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.fc2.weight" in names
    by_dimension, _ = weight_decay_groups(module.model, WEIGHT_DECAY)
    assert by_dimension["params"] == []  # what the tensors' own shapes would give here: no decay at all

    module.trainer = type("Trainer", (), {"strategy": CPUFSDPStrategy()})()
    with caplog.at_level("INFO"):
        optimizer = module.configure_optimizers()["optimizer"]
    assert group_names(module, optimizer) == [(WEIGHT_DECAY, decayed), (0.0, undecayed)]
    decayed_size = sum(sizes[name] for name in decayed)
    assert (
        f"AdamW weight decay 1 on {len(decayed)} tensors ({decayed_size} parameters), none on {len(undecayed)} "
        f"({sum(sizes.values()) - decayed_size} parameters: biases, LayerNorm weights)"
    ) in caplog.text


def test_under_fsdp1_a_parameter_not_built_or_not_found_is_an_error():
    module = built_module("L0_sanity", cpu_trainer())
    built, no_decay = module._built_parameters, module._no_weight_decay
    wrap_like_fsdp1(module.model)
    fsdp1_weight_decay_groups(module.model, 0.1, built, no_decay)  # as built: fine
    module.model.lm_head.extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"not built: \['lm_head.extra'\]"):
        fsdp1_weight_decay_groups(module.model, 0.1, built, no_decay)
    del module.model.lm_head.extra
    module.model.lm_head.decoder.register_parameter("bias", None)
    with pytest.raises(RuntimeError, match=r"not found: \['lm_head.decoder.bias'\]"):
        fsdp1_weight_decay_groups(module.model, 0.1, built, no_decay)


# ------------------------------------------------------------------------------------------------ through train.py

# Step 1 trains the L0 model's init for one step, so that the biases are no longer 0 and the LayerNorm weights no
# longer 1 (a decayed zero would not show); its last.ckpt holds the weights before. The relaunch resumes it for step 2,
# in which only weight decay moves a weight: Adam's own update, lr * m / (sqrt(v) + eps), is at most lr * |g| / eps =
# 5e-12 with eps = 1e10 and gradients clipped to norm 1, below float32's resolution of the weights (the atol below);
# the decay moves each decayed one by 5%. With num_warmup_steps=1 the schedule's ratio is 1 at step 1 ((0 + 1) / 1) and
# at step 2 (the decay's start), so step 2 uses LR itself. (A resume applies the config's lr, eps and per-group
# weight decay: optimizer_settings.py.)
COMMON = [
    "lr_scheduler_kwargs.num_warmup_steps=1",
    "logger.log_every=1",
    "trainer.val_check_interval=1000",
    "data.token_budget=1024",
]
FIRST_STEP = ["num_train_steps=1", "adamw_kwargs.lr=1e-3", "export_final_model=false"]
ONLY_DECAY = ["num_train_steps=2", f"adamw_kwargs.lr={LR}", f"adamw_kwargs.weight_decay={WEIGHT_DECAY}"]
ONLY_DECAY += ["adamw_kwargs.eps=1.0e10"]


def assert_decayed_once(before: dict, after: dict, factor: float, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    """Every decayed weight multiplied by ``factor`` (to float32 rounding), every other one as it was (to ``atol``)."""
    assert set(before) == set(after) == DECAYED | NOT_DECAYED
    for name in NOT_DECAYED:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=atol, msg=name)
        assert before[name].abs().max() > 1e-4, name  # so that a decay by 5% would show
    for name in DECAYED:
        torch.testing.assert_close(after[name], before[name] * factor, rtol=rtol, atol=atol, msg=name)
        assert not torch.equal(after[name], before[name]), name


def assert_logged_groups(log: str) -> None:
    """The log line of the groups, with the L0 model's counts."""
    assert f"AdamW weight decay {WEIGHT_DECAY:g} on {len(DECAYED)} tensors" in log, log[-3000:]
    assert f"none on {len(NOT_DECAYED)} (" in log and "parameters: biases, LayerNorm weights)" in log, log[-3000:]


def one_decay_step(output_dir: Path, *overrides: str, nproc=None, cpu_only=True) -> tuple[dict, dict, str]:
    """Step 1, then the relaunch's ``ONLY_DECAY`` step 2 (see above): (the weights of step 1's last.ckpt, those
    exported after step 2, the relaunch's log)."""
    run_script(
        "train.py", f"output_dir={output_dir}", *COMMON, *FIRST_STEP, *overrides, nproc=nproc, cpu_only=cpu_only
    )
    checkpoint = torch.load(output_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 1
    before = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    result = run_script(
        "train.py", f"output_dir={output_dir}", *COMMON, *ONLY_DECAY, *overrides, nproc=nproc, cpu_only=cpu_only,
        timeout=600,
    )  # fmt: skip
    log = result.stdout + result.stderr
    assert "Resuming from" in log
    lrs = [json.loads(line)["lr"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([1e-3, LR], rel=1e-12)  # step 2 ran with the full LR
    after = load_file(output_dir / "final_model" / "model.safetensors")
    before = {k: v.float() for k, v in before.items() if not k.endswith("_extra_state")}
    return before, {k: v.float() for k, v in after.items()}, log


@pytest.mark.parametrize(("strategy", "nproc"), [("ddp", None), ("fsdp2", 2)], ids=["ddp", "fsdp2-2proc"])
def test_one_step_of_weight_decay_through_train_py_shrinks_only_the_weight_matrices(tmp_path, strategy, nproc):
    """DDP's whole model in one process; FSDP2's sharded over two, its parameters DTensors (whose ndim is the whole
    tensor's). Every weight matrix and the embedding table shrink by lr * weight_decay; every bias and LayerNorm
    weight stays. Before these groups, every LayerNorm weight and bias shrank by 5% here too."""
    before, after, log = one_decay_step(tmp_path, f"strategy={strategy}", nproc=nproc)
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY)
    assert_logged_groups(log)


def test_under_lightnings_fsdp1_on_two_cpu_processes_only_the_weight_matrices_shrink(tmp_path):
    """train.py under Lightning's FSDPStrategy (FSDP1, use_orig_params=True) for real, on two CPU processes
    (tests/scripts/train_fsdp1_on_cpu.py: the recipe itself runs FSDP1 on GPUs only). configure_optimizers sees every
    parameter as a flat 1-D shard under a wrapped name; one step of the init (its LayerNorm weights and biases set
    random by the script) with the ``ONLY_DECAY`` settings shrinks every shard of a weight matrix or the embedding
    table by lr * weight_decay and leaves every other shard as it was. (Decided by the tensors' dimensions, as
    before configure_model recorded the names, nothing would be decayed here.)"""
    overrides = [*COMMON, *ONLY_DECAY, "num_train_steps=1", "checkpoint.save_final=false", "export_final_model=false"]
    result = run_script(
        "tests/scripts/train_fsdp1_on_cpu.py", f"output_dir={tmp_path}", "strategy=fsdp", *overrides, nproc=2
    )
    assert_logged_groups(result.stdout + result.stderr)
    built = built_module("L0_sanity", cpu_trainer())._built_parameters
    sharded, split = dict.fromkeys(built, 0), set()
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert record["strategy"] == "CPUFSDPStrategy" and record["before"].keys() == record["after"].keys()
        assert {name_before_wrapping(name) for name in record["before"]} == DECAYED | NOT_DECAYED
        assert "encodon.layers.0._fsdp_wrapped_module.mlp.fc1.weight" in record["before"]
        for name, before in record["before"].items():
            after, unwrapped = record["after"][name], name_before_wrapping(name)
            assert before.dim() == 1, name  # a flat shard, whatever the tensor's shape
            sharded[unwrapped] += before.numel()
            split |= {unwrapped} if 0 < before.numel() < built[unwrapped] else set()
            if unwrapped in DECAYED:
                torch.testing.assert_close(after, before * (1 - LR * WEIGHT_DECAY), rtol=1e-6, atol=1e-9, msg=name)
                assert before.numel() == 0 or not torch.equal(after, before), name
            else:
                torch.testing.assert_close(after, before, rtol=0, atol=1e-9, msg=name)
                assert before.numel() == 0 or before.abs().min() > 0.4, name  # set around 1: a decay would show
    assert sharded == built and split & DECAYED  # each tensor's shards add up to it; some lie across both ranks


# ------------------------------------------------------------------------------------------- earlier checkpoints


def test_a_checkpoint_with_one_optimizer_parameter_group_is_refused_in_one_line(tmp_path):
    """A checkpoint written before these groups (AdamW over model.parameters(): one group) would fail to load deep in
    Lightning (DDP: "loaded state dict has a different number of parameter groups"; FSDP2: an IndexError among the
    scheduler's learning rates after loading it). The relaunch stops before it builds anything, naming the
    checkpoint and the way out, and touches no file. The checkpoint is a real one of step 1, its groups merged."""
    common = [f"output_dir={tmp_path}", "logger.log_every=1", "data.token_budget=1024", "export_final_model=false"]
    run_script("train.py", *common, "num_train_steps=1")
    path = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    check_optimizer_param_groups(path)  # two groups: resumable
    optimizer = checkpoint["optimizer_states"][0]
    decayed, undecayed = optimizer["param_groups"]
    assert len(decayed["params"]) == len(DECAYED) and len(undecayed["params"]) == len(NOT_DECAYED)
    optimizer["param_groups"] = [{**decayed, "params": decayed["params"] + undecayed["params"]}]
    checkpoint["lr_schedulers"][0]["base_lrs"] = checkpoint["lr_schedulers"][0]["base_lrs"][:1]
    checkpoint["lr_schedulers"][0]["_last_lr"] = checkpoint["lr_schedulers"][0]["_last_lr"][:1]
    torch.save(checkpoint, path)
    with pytest.raises(ConfigError, match="one optimizer parameter group"):
        check_optimizer_param_groups(path)

    files = snapshot(tmp_path)
    result = run_in_process("train.py", *common, "num_train_steps=2", expect_failure=True)
    assert_user_error(result, str(path), "one optimizer parameter group", "start afresh in a new output_dir")
    assert snapshot(tmp_path) == files
