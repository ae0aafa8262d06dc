# Copied from common/activation_recompute.py — edit the source, then run ci/check_copies.py --fix
"""Activation recompute: run a transformer layer so that backward recomputes its activations instead of keeping them.

A layer run this way keeps only its input for backward; its backward first runs the layer's forward again. That costs
about one more forward of the layer (~1/3 of its forward + backward) and frees everything else the layer would have
kept: attention inputs and outputs, the MLP's [tokens, ffn] activations, norms. Models recompute the first
``config.recompute_layers`` layers, or every layer after Hugging Face's ``model.gradient_checkpointing_enable()``.

Layers that hold TransformerEngine modules go through ``te.distributed.checkpoint``, which replays the forward under the same FP8
autocast and keeps delayed-scaling amax histories from being updated twice; other layers through
``torch.utils.checkpoint``. Both run non-reentrant: recompute starts when backward first needs a tensor the layer did
not keep, which also composes with FSDP2 (its pre-backward hook has already gathered the layer's weights by then) and
with Megatron-FSDP (on an H200 its recomputed runs log the plain runs' losses bit for bit).
Dropout masks are reproduced (both save and restore the RNG state), so the gradients equal those of a plain run.

FP8 layers with delayed scaling are refused: on one H100 (TE 2.20, AMPLIFY test model, two steps) their recomputed
run gave the plain run's losses but a layer-norm gradient more than 1% away from it, while bf16 and Float8BlockScaling
layers matched. The cause is not established: delayed scaling starts from a scale of 1, where small gradients fall
into FP8's coarse subnormal range, so a repeated plain run might differ as much (not measured yet). Until a GPU run
settles it, recomputed layers use current or block scaling (or bf16).
"""

import weakref

import torch
import torch.utils.checkpoint


_HOLDS_TE_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _holds_te_modules(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is or contains a TransformerEngine module (a ``te.TransformerLayer``, a layer built from TE
    modules like CodonFM's, or from subclasses of them like the fused layers'): those need TE's checkpoint, which
    replays the forward under the same FP8 autocast."""
    if layer not in _HOLDS_TE_MODULES:
        _HOLDS_TE_MODULES[layer] = any(
            cls.__module__.startswith("transformer_engine") for m in layer.modules() for cls in type(m).__mro__
        )
    return _HOLDS_TE_MODULES[layer]


def call_layer(layer: torch.nn.Module, recompute: bool, *args, **kwargs) -> torch.Tensor:
    """``layer(*args, **kwargs)``, with its activations recomputed in backward when ``recompute`` is true."""
    if not recompute:
        return layer(*args, **kwargs)
    if _holds_te_modules(layer):
        import transformer_engine.pytorch as te  # only reachable where the layer holds TE modules

        return te.distributed.checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, **kwargs)


def recomputes(model: torch.nn.Module, layer_index: int) -> bool:
    """Whether ``model`` (with ``config.recompute_layers`` and HF's ``gradient_checkpointing`` flag) recomputes the
    activations of layer ``layer_index`` in this forward: only while training with autograd on."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    return bool(getattr(model, "gradient_checkpointing", False)) or layer_index < model.config.recompute_layers


def validate_recompute_layers(value, num_hidden_layers: int) -> list[str]:
    """The problems with a config's ``recompute_layers`` (an int from 0 to the number of layers), for its validator."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= num_hidden_layers:
        return [
            f"recompute_layers must be an integer from 0 to num_hidden_layers ({num_hidden_layers}), got {value!r}"
        ]
    return []


def refuse_delayed_scaling(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when a layer that ``model`` recomputes runs FP8 with delayed scaling (see above).

    ``model`` has ``layer_precision`` (per layer: None, "fp8" or "fp4") and ``_recipes`` (precision -> TE recipe)."""
    everything = getattr(model, "gradient_checkpointing", False)
    recomputed = range(len(model.layer_precision) if everything else model.config.recompute_layers)
    for index in recomputed:
        precision = model.layer_precision[index]
        recipe = model._recipes.get(precision) if precision else None
        if recipe is not None and recipe.delayed():
            raise ValueError(
                f"layer {index + 1} is recomputed in backward (recompute_layers / gradient_checkpointing) and runs FP8 "
                "with DelayedScaling, which activation recompute does not support yet: use Float8BlockScaling or "
                "Float8CurrentScaling, or recompute fewer layers"
            )


def recompute_note(config) -> str:
    """For a run's log line: ", activations of N of L layers recomputed in backward", or "" when none are."""
    if not config.recompute_layers:
        return ""
    return f", activations of {config.recompute_layers} of {config.num_hidden_layers} layers recomputed in backward"
