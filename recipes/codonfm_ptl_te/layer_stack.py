# Copied from common/layer_stack.py — edit the source, then run ci/check_copies.py --fix
"""The layer loop of every model but ViT (ESM-2, AMPLIFY, Llama, Geneformer, CodonFM): one call per layer, in its
precision's autocast region, with its activations recomputed where configured, and for
``FusedResidualTransformerLayer`` stacks each layer's last residual add handed to the next layer's first norm kernel.

``run_layer_stack`` is what each model's ``forward_packed`` calls between the embedding and the final norm, so that
the rules of the loop live in one place:

* ``LayerAutocast`` (layer_autocast.py) opens one TE autocast per run of same-precision layers;
* ``call_layer`` / ``recomputes`` (activation_recompute.py) recompute the first ``config.recompute_layers`` layers
  (or all of them under Hugging Face's gradient checkpointing) while training;
* with ``defer_residual`` the layers are called with ``defer_residual=True`` and return ``(mlp_out, residual)``
  unsummed; the pair goes into the next layer as ``(hidden_states, pending_residual)``, and the sum is formed only
  after the last layer (fused_residual_layer.py). The hidden states reported per layer are the sums, as the
  plain layers report them.
"""

import torch


try:  # package import (models/*, exported checkpoints)
    from .activation_recompute import call_layer, recomputes
    from .layer_autocast import LayerAutocast
except ImportError:  # flat copy inside a recipe folder
    from activation_recompute import call_layer, recomputes
    from layer_autocast import LayerAutocast


def run_layer_stack(
    model: torch.nn.Module,
    layers,
    hidden: torch.Tensor,
    autocast: LayerAutocast,
    defer_residual: bool,
    output_hidden_states: bool,
    **layer_kwargs,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Run ``hidden`` through ``layers`` (the layers of ``model``, whose config and training state decide the
    recompute), each called as ``layer(hidden, **layer_kwargs)``. Returns the last layer's output and, with
    ``output_hidden_states``, the list of every layer's input (else None)."""
    all_hidden = [] if output_hidden_states else None
    pending = None  # the residual the previous layer left unsummed (defer_residual only)
    with autocast as regions:
        for index, layer in enumerate(layers):
            if all_hidden is not None:
                all_hidden.append(hidden if pending is None else hidden + pending)
            regions.enter_layer(index)
            deferred = {"pending_residual": pending, "defer_residual": True} if defer_residual else {}
            output = call_layer(layer, recomputes(model, index), hidden, **layer_kwargs, **deferred)
            hidden, pending = output if defer_residual else (output, None)
    if pending is not None:
        hidden = hidden + pending
    return hidden, all_hidden
