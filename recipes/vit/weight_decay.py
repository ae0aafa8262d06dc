"""AdamW's parameter groups for the ViT: weight decay on the weight matrices (and the patch embedding's kernel), none on
biases, LayerNorm weights (those TE fuses into LayerNormLinear and LayerNormMLP too), the class token or the position
embeddings: DeiT's and timm's rule (timm decays no tensor of one dimension, nor what ``no_weight_decay()`` names).
Decay on those would pull the LayerNorm gains, the biases and the learned positions towards zero at every step.

Every entrypoint builds its optimizer over :func:`weight_decay_groups` of its model (whole under DDP; sharded in place
under FSDP2, where a DTensor's ``ndim`` is its whole tensor's). Megatron-FSDP's ``fully_shard`` puts every sharded
parameter into one new group with the optimizer's defaults, so model_setup.py splits it again by name with
:func:`restore_weight_decay_groups`.
"""

import logging

import torch


logger = logging.getLogger(__name__)

# Undecayed besides the tensors of one dimension, by the last part of their name (timm's ViT.no_weight_decay()).
NO_WEIGHT_DECAY = ("cls_token", "position_embeddings")


def skips_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Whether AdamW leaves ``param`` (called ``name`` in ``named_parameters()``) undecayed: a bias, a LayerNorm
    weight (any tensor of at most one dimension; a DTensor's ``ndim`` is its whole tensor's), the class token or the
    position embeddings."""
    return param.ndim <= 1 or name.rsplit(".", 1)[-1] in NO_WEIGHT_DECAY


def no_weight_decay_names(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s parameters that :func:`skips_weight_decay`."""
    return {name for name, param in model.named_parameters() if skips_weight_decay(name, param)}


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups for ``model`` as the optimizer gets it (whole, or sharded by FSDP2): ``weight_decay``
    on the weight matrices and the patch embedding's kernel, 0 on what :func:`skips_weight_decay` names (DeiT's and
    timm's rule). Each parameter is in exactly one group; the counts are logged."""
    groups = _split_by_name(model, weight_decay, no_weight_decay_names(model))
    decayed, undecayed = groups[0]["params"], groups[1]["params"]
    logger.info(
        "AdamW weight decay %g on %d tensors (%d parameters), none on %d (%d parameters: biases, LayerNorm weights, "
        "class token, position embeddings)",
        weight_decay,
        len(decayed),
        sum(p.numel() for p in decayed),
        len(undecayed),
        sum(p.numel() for p in undecayed),
    )
    return groups


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
