"""AdamW with weight-decay groups: decay the weight matrices, not the parameters whose scale carries meaning.

- Biases and every other 1-D parameter (RMSNorm weights, TE's fused ``layer_norm_weight``) get no decay: pulling a
  norm's gain towards 0 fights the normalisation it exists to undo, and biases have no overfitting role to regularise.
- Input embeddings get no decay either when ``embedding_weight_decay`` is false (the recipe's default). Spike No More
  initialises them at std 1.0 on purpose; decay would drag them back towards the small scale whose gradient spikes
  that init avoids. Only the rows of tokens that occur receive gradients, so decay would also shrink rare tokens'
  rows for no reason.

Parameters are classified by shape and by module type (``nn.Embedding``), not by name, so the rule holds for the TE
and torch backends alike and for FSDP2-sharded parameters (a DTensor's ``ndim`` is its global one).
"""

import torch
from adamw import build_adamw
from torch import nn


def split_decay_parameters(model: nn.Module, embedding_weight_decay: bool = False) -> tuple[list[str], list[str]]:
    """(names of parameters with weight decay, names without), each parameter once (tied weights by first name)."""
    embedding_ids = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for name, param in model.named_parameters():
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        skip = param.ndim < 2 or (id(param) in embedding_ids and not embedding_weight_decay)
        (no_decay if skip else decay).append(name)
    return decay, no_decay


def build_optimizer(
    model: nn.Module, cfg, device: torch.device, master_low_bits: dict | None = None
) -> torch.optim.Optimizer:
    """AdamW (adamw.py: ``CompensatedAdamW`` for bf16 weights) over two groups: ``cfg.adamw_kwargs.weight_decay`` for
    weight matrices, 0 for the rest (and for the input embeddings unless ``cfg.embedding_weight_decay``)."""
    decay, no_decay = split_decay_parameters(model, bool(cfg.embedding_weight_decay))
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[name] for name in decay], "weight_decay": cfg.adamw_kwargs.get("weight_decay", 0.0)},
        {"params": [params[name] for name in no_decay], "weight_decay": 0.0},
    ]
    return build_adamw([group for group in groups if group["params"]], cfg, device, master_low_bits)
