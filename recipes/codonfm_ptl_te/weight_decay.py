# Copied from common/weight_decay.py — edit the source, then run ci/check_copies.py --fix
"""AdamW's parameter groups: weight decay on the weight matrices (and embedding tables, convolution kernels: every
tensor of two or more dimensions), none on biases or LayerNorm weights (those TE fuses into LayerNormLinear and
LayerNormMLP too), nor on what the model itself names. Decay on those would pull the LayerNorm gains and the biases
towards zero at every step. This is the rule of timm (no decay on a tensor of one dimension, nor on what
``model.no_weight_decay()`` names), of DeiT, and, for models without such names, of the Hugging Face Trainer (whose
``get_decay_parameter_names`` leaves biases and LayerNorm weights undecayed): BERT-style models such as Geneformer were
pretrained that way.

A model names its further undecayed parameters as timm's do: a method ``no_weight_decay()`` returning a set of
parameter names, each the last part of a name in ``named_parameters()`` (``"cls_token"`` matches
``vit.embeddings.cls_token``; a name in which no parameter's name ends is logged as a warning). The ViT names its
class token and position embeddings there; a model without the method has none.

Every torchrun entrypoint builds its optimizer over :func:`weight_decay_groups` of its model (whole under DDP; sharded
in place under FSDP2, where a DTensor's ``ndim`` is its whole tensor's); the Hugging Face Trainer recipe hands the
complement of :func:`no_weight_decay_names` to the Trainer (its ``get_decay_parameter_names``). Megatron-FSDP's ``fully_shard`` puts every sharded
parameter into one new group with the optimizer's defaults, so model_setup.py splits it again by name with
:func:`restore_weight_decay_groups`. A tied parameter (an MLM decoder sharing the word embeddings) is one tensor:
``named_parameters()`` yields it once, under its first name, so it is in exactly one group.
"""

import logging

import torch


logger = logging.getLogger(__name__)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``torch.compile``'s wrapper (``._orig_mod``) and DDP's or Megatron-FSDP's (``.module``), or
    ``model`` itself (FSDP2 shards a model in place)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and not hasattr(model, "no_weight_decay"):
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def model_no_weight_decay(model: torch.nn.Module) -> frozenset[str]:
    """The parameter names ``model`` (or the model its wrapper holds) leaves undecayed through timm's
    ``no_weight_decay()``: empty for a model without that method."""
    method = getattr(unwrapped(model), "no_weight_decay", None)
    return frozenset(method()) if callable(method) else frozenset()


def skips_weight_decay(name: str, param: torch.Tensor, model_names: frozenset[str] = frozenset()) -> bool:
    """Whether AdamW leaves ``param`` (called ``name`` in ``named_parameters()``) undecayed: a bias or a LayerNorm
    weight (any tensor of at most one dimension; a DTensor's ``ndim`` is its whole tensor's), or a parameter whose
    name ends in one of ``model_names`` (what the model's ``no_weight_decay()`` returns)."""
    return param.ndim <= 1 or name.rsplit(".", 1)[-1] in model_names


def no_weight_decay_names(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s parameters that :func:`skips_weight_decay`."""
    model_names = model_no_weight_decay(model)
    named = dict(model.named_parameters())
    unmatched = model_names - {name.rsplit(".", 1)[-1] for name in named}
    if unmatched:  # a misspelt name, or a whole name where the last part is wanted: those tensors would be decayed
        logger.warning("no_weight_decay() names %s, which no parameter's name ends in", sorted(unmatched))
    return {name for name, param in named.items() if skips_weight_decay(name, param, model_names)}


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups for ``model`` as the optimizer gets it (whole, or sharded by FSDP2): ``weight_decay``
    on the tensors of two or more dimensions, 0 on what :func:`skips_weight_decay` names. Each parameter is in exactly
    one group; the counts are logged."""
    groups = _split_by_name(model, weight_decay, no_weight_decay_names(model))
    log_weight_decay_groups(
        model, weight_decay, [p.numel() for p in groups[0]["params"]], [p.numel() for p in groups[1]["params"]]
    )
    return groups


def log_weight_decay_groups(
    model: torch.nn.Module, weight_decay: float, decayed_numels: list[int], undecayed_numels: list[int]
) -> None:
    """One line with the tensor and parameter counts of the two groups (whole tensors' sizes)."""
    named = sorted(model_no_weight_decay(model))
    logger.info(
        "AdamW weight decay %g on %d tensors (%d parameters), none on %d (%d parameters: biases, LayerNorm weights%s)",
        weight_decay,
        len(decayed_numels),
        sum(decayed_numels),
        len(undecayed_numels),
        sum(undecayed_numels),
        f", and the model's no_weight_decay(): {', '.join(named)}" if named else "",
    )


def _split_by_name(module: torch.nn.Module, weight_decay: float, no_decay: set[str]) -> list[dict]:
    decay, undecayed = [], []
    for name, param in module.named_parameters():
        (undecayed if name in no_decay else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": undecayed, "weight_decay": 0.0}]


def restore_weight_decay_groups(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, no_decay: set[str], weight_decay: float
) -> None:
    """After ``megatron_fsdp.fully_shard(model, optimizer)``: it replaces the optimizer's parameter groups by one group
    of its sharded parameters with the optimizer's defaults (every tensor decayed). Split that group again, by the
    names ``no_decay`` of the undecayed parameters taken from the model before sharding; ``module`` (the wrapper's
    ``.module``) holds the sharded parameters under the same names. The state built for each parameter stays."""
    sharded = [param for group in optimizer.param_groups for param in group["params"]]
    groups = _split_by_name(module, weight_decay, no_decay)
    regrouped = [param for group in groups for param in group["params"]]
    names = {name for name, _ in module.named_parameters()}
    if {id(p) for p in regrouped} != {id(p) for p in sharded} or len(regrouped) != len(sharded) or no_decay - names:
        raise RuntimeError(
            "Megatron-FSDP's sharded parameters are not the model's named parameters: cannot keep the weight decay "
            f"groups ({len(sharded)} in the optimizer, {len(regrouped)} named; not found: {sorted(no_decay - names)})"
        )
    settings = {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}
    optimizer.param_groups.clear()
    for group in groups:
        optimizer.add_param_group({**settings, **group})
