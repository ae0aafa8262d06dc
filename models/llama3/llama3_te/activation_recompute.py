# Copied from common/activation_recompute.py — edit the source, then run ci/check_copies.py --fix
"""Activation recompute: run a transformer layer so that backward recomputes its activations instead of keeping them.

A layer run this way keeps only its input for backward; its backward first runs the layer's forward again. That costs
about one more forward of the layer (~1/3 of its forward + backward) and frees everything else the layer would have
kept: attention inputs and outputs, the MLP's [tokens, ffn] activations, norms. Models recompute the first
``config.recompute_layers`` layers, or every layer after Hugging Face's ``model.gradient_checkpointing_enable()``.

Every recomputed layer runs through ``torch.utils.checkpoint``, non-reentrant: recompute starts when backward first
needs a tensor the layer did not keep, which also composes with FSDP2 (its pre-backward hook has already gathered the
layer's weights by then) and with Megatron-FSDP (on an H200 its recomputed runs log the plain runs' losses bit for
bit). Dropout masks are reproduced (the RNG state is saved and restored), so the gradients equal those of a plain run.

Layers that hold TransformerEngine modules also get TE's recompute contexts (``_te_recompute_contexts``): in the
second forward TE's modules swap in the FP8 scales the first one used, so delayed scaling recomputes the same FP8
values, and that forward runs under the FP8 autocast the layer ran in. ``te.distributed.checkpoint`` (TE 2.20) enters
that autocast as an outermost one, and leaving an outermost autocast runs delayed scaling's update of every scale
(layer_autocast.py): once more per recomputed layer and step (an H200 probe, 3 recomputed layers: 4 forward updates
and 1 backward update per step, where the plain run has 1 and 1; its amax histories, scales, losses and gradients came
out the same as the plain run's there). Here the autocast is nested in a disabled one, so the update runs once per
step and direction, as without recompute. The backward runs the first forward's autograd nodes (only their saved
tensors come from the second forward), so the first FP8 module still updates the gradients' scales once, at the end of
backward. Recomputed delayed-scaling layers give the plain run's losses, gradients, amax histories and scales
(docs/benchmarks.md; the models' GPU contract).
"""

import contextlib
import weakref

import torch
import torch.utils.checkpoint


_HOLDS_TE_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _holds_te_modules(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is or contains a TransformerEngine module (a ``te.TransformerLayer``, a layer built from TE
    modules like CodonFM's, or from subclasses of them like the fused layers'): those need TE's recompute contexts."""
    if layer not in _HOLDS_TE_MODULES:
        _HOLDS_TE_MODULES[layer] = any(
            cls.__module__.startswith("transformer_engine") for m in layer.modules() for cls in type(m).__mro__
        )
    return _HOLDS_TE_MODULES[layer]


def _te_recompute_contexts():
    """``(forward, recompute)`` contexts for ``torch.utils.checkpoint``'s ``context_fn``, for a layer of TE modules
    (see the module docstring). Called as the layer's forward starts, under the FP8 autocast it runs in."""
    import transformer_engine.pytorch as te  # only reachable where the layer holds TE modules
    from transformer_engine.pytorch.distributed import get_activation_recompute_contexts
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    fp8 = FP8GlobalStateManager.is_fp8_enabled()
    recipe = FP8GlobalStateManager.get_fp8_recipe() if fp8 else None
    forward_context, recompute_phase = get_activation_recompute_contexts()

    @contextlib.contextmanager
    def recompute_context():
        # The disabled region outside makes the FP8 one inner: leaving it then updates no scale.
        with te.autocast(enabled=False), te.autocast(enabled=fp8, recipe=recipe), recompute_phase:
            yield

    return forward_context, recompute_context()


def call_layer(layer: torch.nn.Module, recompute: bool, *args, **kwargs) -> torch.Tensor:
    """``layer(*args, **kwargs)``, with its activations recomputed in backward when ``recompute`` is true."""
    if not recompute:
        return layer(*args, **kwargs)
    if not _holds_te_modules(layer):
        return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, **kwargs)
    # The whole forward again, never stopped early (torch stops it once the last kept tensor is recomputed): TE pairs
    # each module's first and second forward through a queue of its saved scales, which a skipped module would leave
    # one entry long.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return torch.utils.checkpoint.checkpoint(
            layer, *args, use_reentrant=False, context_fn=_te_recompute_contexts, **kwargs
        )


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


def recompute_note(config) -> str:
    """For a run's log line: ", activations of N of L layers recomputed in backward", or "" when none are."""
    if not config.recompute_layers:
        return ""
    return f", activations of {config.recompute_layers} of {config.num_hidden_layers} layers recomputed in backward"
