"""weight_decay.py: AdamW decays Geneformer's weight matrices and embedding tables and nothing else (no bias, no
LayerNorm weight), as the Hugging Face Trainer that pretrained Geneformer did, under every strategy.

References: the L0 model's parameter names written out by hand; the Hugging Face Trainer's own rule
(``Trainer.get_decay_parameter_names``) on the stock ``BertForMaskedLM`` of the same shape, its names translated by the
conversion's key maps; and what weight decay alone does to a weight: one AdamW step multiplies a decayed weight by
``1 - lr * weight_decay`` and leaves an undecayed one as it was. The entrypoints are run the way a user runs them
(``tests/test_train_gpu.py`` runs them on a GPU with TE's layers and Megatron-FSDP too).
"""

import re
from pathlib import Path

import pytest
import torch
from adamw import build_adamw, megatron_fsdp_init_step_left_out
from convert import _LAYER_KEY_MAP, _SHARED_KEY_MAP, convert_geneformer_hf_to_te
from launch import run_script
from modeling_geneformer_te import NVGeneformerConfig, NVGeneformerForMaskedLM
from omegaconf import OmegaConf
from test_train import load_export
from transformers import BertConfig, BertForMaskedLM, Trainer
from weight_decay import no_weight_decay_names, restore_weight_decay_groups, weight_decay_groups


RECIPE_DIR = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
LR, WEIGHT_DECAY = 0.1, 0.5  # one step of decay multiplies a weight by 0.95
# The L0 model's shape (hydra_config/L0_sanity.yaml: 2 layers, hidden 128, 1,024 genes).
L0_SHAPE = OmegaConf.to_container(
    OmegaConf.load(RECIPE_DIR / "hydra_config" / "L0_sanity.yaml").model_config_overrides
)

# The L0 model, parameter by parameter (TE's and the torch backend's names are the same; models/geneformer's tests
# pin them together). The MLM decoder's weight is the word embeddings' (tied): one parameter, named once.
LAYER_DECAYED = (
    "self_attention.qkv.weight",
    "self_attention.proj.weight",
    "layernorm_mlp.fc1_weight",
    "layernorm_mlp.fc2_weight",
)
LAYER_NOT_DECAYED = (
    "self_attention.qkv.bias",
    "self_attention.proj.bias",
    "layernorm_mlp.layer_norm_weight",  # the post-attention LayerNorm, fused into the MLM's LayerNormMLP
    "layernorm_mlp.layer_norm_bias",
    "layernorm_mlp.fc1_bias",
    "layernorm_mlp.fc2_bias",
    "layernorm.weight",  # the layer's output LayerNorm (post-norm)
    "layernorm.bias",
)
LAYERS = [f"bert.encoder.layers.{i}." for i in range(2)]
DECAYED = {
    "bert.embeddings.word_embeddings.weight",  # and the tied lm_head.decoder.weight
    "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight",
    "lm_head.dense.weight",
} | {layer + name for layer in LAYERS for name in LAYER_DECAYED}
NOT_DECAYED = {
    "bert.embeddings.layer_norm.weight",
    "bert.embeddings.layer_norm.bias",
    "lm_head.dense.bias",
    "lm_head.layer_norm.weight",
    "lm_head.layer_norm.bias",
    "lm_head.bias",
} | {layer + name for layer in LAYERS for name in LAYER_NOT_DECAYED}
TIED = {"lm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}


def stock_bert() -> BertForMaskedLM:
    """A stock Hugging Face BertForMaskedLM of the L0 shape with Geneformer's settings. Every tensor of one dimension
    is random around 1 (biases start at 0, LayerNorm weights at 1, which would hide a decayed bias or look like an
    untouched gain), so that any decay shows."""
    config = BertConfig(**L0_SHAPE, hidden_act="relu", layer_norm_eps=1e-12, pad_token_id=0)
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model


def l0_model() -> NVGeneformerForMaskedLM:
    """The L0 model (torch backend) with every parameter random and non-zero."""
    config = NVGeneformerConfig.from_pretrained(RECIPE_DIR / "model_configs" / "geneformer_10M", backend="torch")
    config.update(L0_SHAPE)
    torch.manual_seed(0)
    model = NVGeneformerForMaskedLM(config)
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


def assert_decayed_once(before: dict, after: dict, factor: float, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """Every decayed weight (by parameter or state-dict name: the tied decoder's too) multiplied by ``factor`` (to
    float32 rounding; ``rtol=1e-2`` for bf16 weights), every other one as it was (to ``atol``)."""
    assert set(before) == set(after) and set(before) - set(TIED) == DECAYED | NOT_DECAYED
    for name in NOT_DECAYED:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=atol, msg=name)
    for name in DECAYED | set(TIED) & set(before):
        torch.testing.assert_close(after[name], before[name] * factor, rtol=rtol, atol=atol, msg=name)
        assert not torch.equal(after[name], before[name]), name


def test_the_groups_hold_every_parameter_once_and_decay_only_the_weight_matrices():
    model = l0_model()
    assert {name for name, _ in model.named_parameters()} == DECAYED | NOT_DECAYED  # the list above is complete
    assert model.lm_head.decoder.weight is model.bert.embeddings.word_embeddings.weight  # tied
    groups = weight_decay_groups(model, WEIGHT_DECAY)
    assert [group["weight_decay"] for group in groups] == [WEIGHT_DECAY, 0.0]
    ids = [id(param) for group in groups for param in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # each parameter in exactly one group
    names = {id(param): name for name, param in model.named_parameters()}
    assert {names[id(p)] for p in groups[0]["params"]} == DECAYED
    assert {names[id(p)] for p in groups[1]["params"]} == NOT_DECAYED
    # The rule, stated independently: the tensors of one dimension, nothing named besides.
    assert {name for name, param in model.named_parameters() if param.dim() == 1} == NOT_DECAYED
    assert no_weight_decay_names(model) == NOT_DECAYED


def nv_name(hf_name: str) -> str:
    """The NV parameter a stock BertForMaskedLM parameter becomes (convert.py's key maps; q, k and v are fused)."""
    if hf_name in _SHARED_KEY_MAP:
        return _SHARED_KEY_MAP[hf_name]
    if hf_name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"):
        return "bert.embeddings.word_embeddings.weight"
    if hf_name in ("cls.predictions.bias", "cls.predictions.decoder.bias"):
        return "lm_head.bias"
    layer, suffix = re.fullmatch(r"bert\.encoder\.layer\.(\d+)\.(.+)", hf_name).groups()
    suffix = _LAYER_KEY_MAP.get(suffix) or re.sub(
        r"attention\.self\.(query|key|value)\.", "self_attention.qkv.", suffix
    )
    return f"bert.encoder.layers.{layer}.{suffix}"


def test_the_groups_are_what_the_hugging_face_trainer_decays():
    """Geneformer was pretrained with the Hugging Face Trainer: the parameters its AdamW decays in the stock model
    are the ones decayed here, once converted (and every converted parameter is on one side only)."""
    hf_model = stock_bert()
    hf_decayed = set(Trainer.get_decay_parameter_names(None, hf_model))
    hf_names = [name for name, _ in hf_model.named_parameters(remove_duplicate=False)]
    expected_decayed = {nv_name(name) for name in hf_names if name in hf_decayed}
    expected_undecayed = {nv_name(name) for name in hf_names if name not in hf_decayed}
    assert not expected_decayed & expected_undecayed
    assert (expected_decayed, expected_undecayed) == (DECAYED, NOT_DECAYED)
    model = convert_geneformer_hf_to_te(hf_model, backend="torch")
    (_, decayed), (_, undecayed) = group_names(model, build_adamw(weight_decay_groups(model, 0.1), config(), CPU))
    assert (set(decayed), set(undecayed)) == (expected_decayed, expected_undecayed)


@pytest.mark.parametrize("fp32_master_weights", [True, False], ids=["torch-adamw", "compensated-bf16"])
def test_one_step_on_zero_gradients_decays_only_the_weight_matrices(fp32_master_weights):
    """torch's AdamW (fp32 weights on the CPU) and CompensatedAdamW (bf16 weights) honour each group's weight decay.
    (With the decay applied to every parameter, as before, the LayerNorm weights and the biases would shrink by 5%.)"""
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
    replaced by its sharded stand-in under the same name (a tied one by one stand-in: Megatron-FSDP re-establishes
    shared weights), the optimizer's groups by one new group of those with the optimizer's defaults, then a step on
    zero gradients to build the state."""
    stand_ins = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        module_name, _, attribute = name.rpartition(".")
        stand_in = stand_ins.setdefault(id(param), torch.nn.Parameter(param.detach().clone()))
        setattr(model.get_submodule(module_name), attribute, stand_in)
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
    assert model.lm_head.decoder.weight is model.bert.embeddings.word_embeddings.weight  # still tied
    assert [decay for decay, _ in group_names(model, optimizer)] == [WEIGHT_DECAY]  # one group: everything decayed

    restore_weight_decay_groups(optimizer, model, no_decay, WEIGHT_DECAY)
    (decay, decayed), (no_decay_value, undecayed) = group_names(model, optimizer)
    assert (decay, set(decayed), no_decay_value, set(undecayed)) == (WEIGHT_DECAY, DECAYED, 0.0, NOT_DECAYED)
    assert len(decayed) + len(undecayed) == len(DECAYED | NOT_DECAYED)  # the tied weight once
    assert all(group["lr"] == LR for group in optimizer.param_groups)  # the learning rate the context restored
    assert all(optimizer.state[p]["step"] == 0 for p in model.parameters())  # the state built at sharding is kept

    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    after = {name: param.detach().clone() for name, param in model.named_parameters()}
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY)


# ------------------------------------------------------------------------------------ through the entrypoints

# One optimizer step in which only weight decay moves a weight: Adam's own update, lr * m / (sqrt(v) + eps), is at
# most lr * |g| / eps = 1e-11 with eps = 1e10 and gradients clipped to norm 1, below float32's resolution of the
# undecayed weights (around 1); the decay moves each decayed one by 5%.
ONLY_DECAY = [
    "num_train_steps=1",
    f"adamw_kwargs.lr={LR}",
    f"adamw_kwargs.weight_decay={WEIGHT_DECAY}",
    "adamw_kwargs.eps=1.0e10",
    "lr_scheduler_kwargs.num_warmup_steps=0",  # the configured lr at the first step
    "logger.log_every=1",
    "dataset.num_workers=0",
    "checkpoint.save_final=false",
    "init_from_pretrained=true",
]


def one_decay_step(tmp_path: Path, script: str, *overrides: str, nproc=None, cpu_only=True) -> tuple[dict, dict, str]:
    """The entrypoint fine-tunes a stock checkpoint of the L0 shape for one ``ONLY_DECAY`` step: (the weights it
    loaded, converted here, those it exported, and its log)."""
    hf_model = stock_bert()
    hf_model.save_pretrained(tmp_path / "stock")
    args = [f"output_dir={tmp_path / 'run'}", f"model_tag={tmp_path / 'stock'}", *ONLY_DECAY, *overrides]
    result = run_script(script, *args, nproc=nproc, cpu_only=cpu_only, timeout=600)
    before = convert_geneformer_hf_to_te(hf_model, backend="torch").state_dict()
    after = load_export(tmp_path / "run").state_dict()
    keep = [key for key in before if not key.endswith("_extra_state")]
    return {key: before[key] for key in keep}, {key: after[key].float() for key in keep}, result.stdout + result.stderr


def assert_logged_groups(log: str) -> None:
    """The log line of weight_decay.weight_decay_groups, with the L0 model's counts (and no class token)."""
    assert f"AdamW weight decay {WEIGHT_DECAY:g} on {len(DECAYED)} tensors" in log, log
    assert f"none on {len(NOT_DECAYED)} (" in log and "parameters: biases, LayerNorm weights)" in log, log


@pytest.mark.parametrize(("script", "nproc"), [("train_ddp.py", None), ("train_fsdp2.py", 2)], ids=["ddp", "fsdp2"])
def test_entrypoints_decay_only_the_weight_matrices(tmp_path, script, nproc):
    """DDP's whole model; FSDP2's sharded over two processes, its parameters DTensors (named and sized as the whole
    tensors). Before this rule every LayerNorm weight and bias shrank by 5% here."""
    before, after, log = one_decay_step(tmp_path, script, nproc=nproc)
    assert_decayed_once(before, after, 1 - LR * WEIGHT_DECAY, atol=1e-9)
    assert_logged_groups(log)
