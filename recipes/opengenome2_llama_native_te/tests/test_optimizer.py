"""Weight-decay groups: which parameters decay, by name, and what one AdamW step does to each group."""

import pytest
import torch
from compensated_adamw import CompensatedAdamW
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from omegaconf import OmegaConf
from optimizer import build_optimizer, split_decay_parameters
from recipe_paths import recipe_path


def tiny_model(**overrides) -> NVLlamaForCausalLM:
    torch.manual_seed(0)
    config = NVLlamaConfig.from_pretrained(recipe_path("model_configs/llama3-tiny-nucleotide"), backend="torch")
    for key, value in overrides.items():
        setattr(config, key, value)
    return NVLlamaForCausalLM(config)


def optimizer_config(adamw_kwargs: dict, embedding_weight_decay: bool = False, fp32_master_weights: bool = True):
    mixed_precision = {"enabled": True, "on_cpu": True, "fp32_master_weights": fp32_master_weights}
    return OmegaConf.create(
        {
            "adamw_kwargs": adamw_kwargs,
            "embedding_weight_decay": embedding_weight_decay,
            "mixed_precision": {**mixed_precision, "compensate_bf16_updates": True},
        }
    )


CPU = torch.device("cpu")
LAYER_MATRICES = ["self_attention.layernorm_qkv.weight", "self_attention.proj.weight", "layernorm_mlp.fc1_weight"]
LAYER_MATRICES += ["layernorm_mlp.fc2_weight"]
LAYER_NORMS = ["self_attention.layernorm_qkv.layer_norm_weight", "layernorm_mlp.layer_norm_weight"]


def test_groups_by_name():
    decay, no_decay = split_decay_parameters(tiny_model())
    layers = [f"model.layers.{i}." for i in range(2)]
    assert sorted(decay) == sorted([p + m for p in layers for m in LAYER_MATRICES] + ["lm_head.weight"])
    assert sorted(no_decay) == sorted(
        [p + n for p in layers for n in LAYER_NORMS] + ["model.norm.weight"] + ["model.embed_tokens.weight"]
    )


def test_embeddings_decay_when_asked():
    decay, no_decay = split_decay_parameters(tiny_model(), embedding_weight_decay=True)
    assert "model.embed_tokens.weight" in decay and "model.embed_tokens.weight" not in no_decay


def test_biases_never_decay():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = split_decay_parameters(model, embedding_weight_decay=True)
    assert decay == ["0.weight", "1.weight"] and no_decay == ["1.bias", "2.weight", "2.bias"]


def test_one_step_decays_only_the_decay_group():
    """With zero gradients AdamW's update is the decay alone: w <- w * (1 - lr * weight_decay) for the decay group,
    nothing for the others."""
    model = tiny_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = optimizer_config({"lr": 0.1, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.5})
    optimizer = build_optimizer(model, cfg, CPU)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.5, 0.0]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    decay, _ = split_decay_parameters(model)
    for name, param in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if name in decay else 1.0
        torch.testing.assert_close(param.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)


def test_tied_weights_are_counted_once():
    model = tiny_model(tie_word_embeddings=True)
    model.tie_weights()
    decay, no_decay = split_decay_parameters(model)
    assert len(decay) + len(no_decay) == len(set(decay + no_decay)) == len(list(model.parameters()))


@pytest.mark.parametrize("embedding_weight_decay", [False, True])
def test_every_parameter_is_in_exactly_one_group(embedding_weight_decay):
    model = tiny_model()
    optimizer = build_optimizer(
        model, optimizer_config({"lr": 1e-3, "weight_decay": 0.1}, embedding_weight_decay), CPU
    )
    grouped = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())


def test_bf16_weights_keep_their_groups_under_the_compensated_optimizer():
    model = tiny_model().to(torch.bfloat16)
    cfg = optimizer_config({"lr": 1e-3, "weight_decay": 0.1}, fp32_master_weights=False)
    optimizer = build_optimizer(model, cfg, CPU)
    assert type(optimizer) is CompensatedAdamW
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
