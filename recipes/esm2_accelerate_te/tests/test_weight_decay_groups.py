# Copied from common/tests/test_weight_decay_groups.py — edit the source, then run ci/check_copies.py --fix
"""weight_decay: AdamW's two parameter groups for any model: decay on the tensors of two or more dimensions, none on
biases, LayerNorm weights or what the model's own ``no_weight_decay()`` names (timm's convention), found through DDP's,
Megatron-FSDP's and ``torch.compile``'s wrappers; a tied parameter in one group only; Megatron-FSDP's merged group
split again. (Each recipe's own tests check its model's groups by name and what its entrypoints build.)

References: the toy models' parameter names written out by hand, and the Hugging Face Trainer's own rule
(``Trainer.get_decay_parameter_names``) for a model without ``no_weight_decay()``.
"""

import logging

import pytest
import torch
from torch import nn
from weight_decay import (
    model_no_weight_decay,
    no_weight_decay_names,
    restore_weight_decay_groups,
    unwrapped,
    weight_decay_groups,
)


WEIGHT_DECAY = 0.1


class TiedLM(nn.Module):
    """Embeddings, a LayerNorm, a linear layer and a decoder tied to the embeddings (an MLM head), plus a learned
    position table: the shapes of a BERT-style model."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(10, 4)
        self.positions = nn.Parameter(torch.randn(1, 6, 4))
        self.norm = nn.LayerNorm(4)
        self.dense = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 10, bias=False)
        self.decoder.weight = self.embeddings.weight
        self.bias = nn.Parameter(torch.zeros(10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.dense(self.norm(self.embeddings(ids) + self.positions[:, : ids.shape[-1]]))
        return self.decoder(hidden) + self.bias


class NamedLM(TiedLM):
    """The same, naming its position table undecayed, as timm's ViT names ``pos_embed``."""

    def no_weight_decay(self) -> set[str]:
        return {"positions"}


class Wrapper(nn.Module):
    """What DDP and Megatron-FSDP look like from outside: the model under ``.module``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


DECAYED = {"embeddings.weight", "positions", "dense.weight"}
UNDECAYED = {"norm.weight", "norm.bias", "dense.bias", "bias"}


def group_names(model: nn.Module, groups: list[dict]) -> list[tuple[float, set[str]]]:
    names = {id(param): name for name, param in model.named_parameters()}
    return [(group["weight_decay"], {names[id(p)] for p in group["params"]}) for group in groups]


def test_tensors_of_one_dimension_are_undecayed_and_a_tied_parameter_is_in_one_group():
    model = TiedLM()
    groups = weight_decay_groups(model, WEIGHT_DECAY)
    assert group_names(model, groups) == [(WEIGHT_DECAY, DECAYED), (0.0, UNDECAYED)]
    ids = [id(p) for group in groups for p in group["params"]]
    assert len(ids) == len(set(ids)) == 7  # the decoder's weight is the embeddings': once, under its first name
    assert model.decoder.weight is model.embeddings.weight


def test_the_hugging_face_trainers_rule_for_a_model_without_names():
    """A stock BERT (tiny): the groups hold exactly the parameters the Hugging Face Trainer decays (by its own
    ``get_decay_parameter_names``) and the others; the decoder's tied weight and bias count once."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    trainer_decays = set(transformers.Trainer.get_decay_parameter_names(None, model))
    (_, decayed), (_, undecayed) = group_names(model, weight_decay_groups(model, WEIGHT_DECAY))
    named = {name for name, _ in model.named_parameters()}
    assert decayed == trainer_decays & named and undecayed == named - trainer_decays
    assert {name for name in undecayed if "LayerNorm" in name} and {name for name in undecayed if "bias" in name}


@pytest.mark.parametrize(
    "wrap",
    [lambda m: m, Wrapper, lambda m: Wrapper(Wrapper(m)), torch.compile],
    ids=["bare", "ddp-like", "nested", "torch-compile"],
)
def test_the_models_no_weight_decay_is_found_through_wrappers(wrap):
    inner = NamedLM()
    model = wrap(inner)
    assert unwrapped(model) is inner
    assert model_no_weight_decay(model) == {"positions"}
    prefix = {name.removesuffix("positions") for name, _ in model.named_parameters() if name.endswith("positions")}
    (decay, decayed), (no_decay, undecayed) = group_names(model, weight_decay_groups(model, WEIGHT_DECAY))
    assert (decay, no_decay) == (WEIGHT_DECAY, 0.0)
    (prefix,) = prefix  # "", "module.", "module.module." or "_orig_mod."
    assert decayed == {prefix + name for name in DECAYED - {"positions"}}
    assert undecayed == {prefix + name for name in UNDECAYED | {"positions"}}


def test_a_model_without_the_method_names_nothing():
    assert model_no_weight_decay(Wrapper(TiedLM())) == frozenset()


def test_the_log_names_what_the_model_names_and_nothing_else(caplog):
    with caplog.at_level(logging.INFO, logger="weight_decay"):
        weight_decay_groups(TiedLM(), WEIGHT_DECAY)
        weight_decay_groups(NamedLM(), WEIGHT_DECAY)
    plain, named = (record.getMessage() for record in caplog.records)
    assert plain.endswith("none on 4 (22 parameters: biases, LayerNorm weights)"), plain
    assert named.endswith(
        "none on 5 (46 parameters: biases, LayerNorm weights, and the model's no_weight_decay(): positions)"
    )
    assert "class token" not in plain + named


def test_a_name_no_parameter_ends_in_is_warned_about(caplog):
    class Misnamed(TiedLM):
        def no_weight_decay(self):
            return {"model.positions", "bias"}  # a whole name where the last part is wanted

    with caplog.at_level(logging.WARNING, logger="weight_decay"):
        assert no_weight_decay_names(Misnamed()) == UNDECAYED  # the positions are decayed
    assert "['model.positions']" in caplog.text


def test_groups_are_restored_after_megatron_fsdp_merges_them():
    """Megatron-FSDP's ``fully_shard`` (imitated: every parameter replaced under its name, the tie kept, one group of
    them with the defaults): split again by the names taken before, each parameter's state kept."""
    model = NamedLM()
    no_decay = no_weight_decay_names(model)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=0.5, weight_decay=WEIGHT_DECAY)
    replaced = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        new = replaced.setdefault(id(param), nn.Parameter(param.detach().clone()))
        module_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module_name), attribute, new)
    optimizer.param_groups.clear()
    optimizer.add_param_group({"params": list(model.parameters())})
    model(torch.arange(5)).sum().backward()
    optimizer.step()
    state = {id(p): optimizer.state[p]["exp_avg"].clone() for p in model.parameters()}

    restore_weight_decay_groups(optimizer, model, no_decay, WEIGHT_DECAY)
    assert group_names(model, optimizer.param_groups) == [
        (WEIGHT_DECAY, DECAYED - {"positions"}),
        (0.0, UNDECAYED | {"positions"}),
    ]
    assert all(group["lr"] == 0.5 for group in optimizer.param_groups)
    assert all(torch.equal(optimizer.state[p]["exp_avg"], state[id(p)]) for p in model.parameters())

    with pytest.raises(RuntimeError, match="not the model's named parameters"):
        restore_weight_decay_groups(optimizer, NamedLM(), no_decay, WEIGHT_DECAY)
