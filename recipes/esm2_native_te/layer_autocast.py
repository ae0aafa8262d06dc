# Copied from common/layer_autocast.py — edit the source, then run ci/check_copies.py --fix
"""Per-layer precision (``config.layer_precision``): one TransformerEngine autocast per run of same-precision layers.

A model's layers each run in high precision (``None``), ``"fp8"`` or ``"fp4"``. ``LayerAutocast`` enters TE's
autocast once for each run of consecutive layers that share a precision, not once per layer, because leaving an
outermost TE autocast is not free under FP8 ``DelayedScaling``: TE keeps one amax buffer per recipe that holds every
FP8 module that has run under it (here, the whole layer stack), and each exit from an outermost autocast concatenates
all of those amaxes, updates every scale and rolls every amax history by one row; the backward of the first FP8
module of each autocast region does the same for the gradients. With an autocast per layer, that happened once per
layer and direction (for ESM-2 3B, 36 concatenations and updates in forward and 36 in backward), and every amax
history rolled 36 times per step, so an ``amax_history_len=1024`` history held only the last ~28 steps, mostly as
zero rows. One autocast per run restores TE's intended once-per-step update (the host work it saves was within the
noise of a 3B FP8 step: docs/benchmarks.md). Current and block scaling keep no such buffer; for them the change only
saves the cost of entering and leaving the contexts.

Use it around the layer loop::

    with LayerAutocast(self.layer_precision, self._recipes, te.autocast if self.backend == "te" else None) as regions:
        for index, layer in enumerate(self.layers):
            regions.enter_layer(index)
            hidden = layer(hidden)

Without TE (``autocast=None``) or without any quantized layer it enters nothing, so an autocast the caller holds (say
accelerate's ``fp8_autocast`` around the whole forward) stays in charge.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager


LAYER_PRECISIONS = (None, "fp8", "fp4")


def validate_layer_precision(layer_precision: Sequence | None, num_hidden_layers: int) -> list[str]:
    """What is wrong with a config's ``layer_precision`` (None, or one of ``LAYER_PRECISIONS`` per layer), as
    messages for the config's ``ValueError``; empty when nothing is."""
    if layer_precision is None:
        return []
    problems = []
    if len(layer_precision) != num_hidden_layers:
        problems.append(f"layer_precision has {len(layer_precision)} entries for {num_hidden_layers} layers")
    bad = sorted({str(p) for p in layer_precision if p not in LAYER_PRECISIONS})
    if bad:
        problems.append(f"layer_precision entries must be None, 'fp8' or 'fp4', got {bad}")
    return problems


class LayerAutocast:
    """Switch TE autocast regions as a layer loop moves from one precision to the next (see the module docstring).

    ``layer_precision``: one entry per layer, None, "fp8" or "fp4". ``recipes``: precision -> TE recipe (or None).
    ``autocast``: ``transformer_engine.pytorch.autocast`` (called as ``autocast(enabled=..., recipe=...)``), or None
    where the model does not run TE.
    """

    def __init__(
        self, layer_precision: Sequence, recipes: dict, autocast: Callable[..., AbstractContextManager] | None
    ):
        self._precision = list(layer_precision)
        self._recipes = recipes
        quantized = any(precision is not None for precision in self._precision)
        self._autocast = autocast if quantized else None
        self._open: tuple[object, AbstractContextManager] | None = None  # (precision, context) of the current run

    def __enter__(self) -> "LayerAutocast":
        return self

    def enter_layer(self, index: int) -> None:
        """Call right before running layer ``index`` (in order): opens a new region where its precision differs from
        the previous layer's, and keeps the current one otherwise."""
        if self._autocast is None:
            return
        precision = self._precision[index]
        if self._open is not None and self._open[0] == precision:
            return
        self._close(None, None, None)
        recipe = self._recipes.get(precision) if precision is not None else None
        # A high-precision run inside a model with quantized layers is an explicit disabled region, so that an
        # outer FP8 autocast cannot quantize it.
        context = self._autocast(enabled=recipe is not None, recipe=recipe)
        context.__enter__()
        self._open = (precision, context)

    def _close(self, exc_type, exc, traceback) -> None:
        if self._open is not None:
            _, context = self._open
            self._open = None
            context.__exit__(exc_type, exc, traceback)

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._close(exc_type, exc, traceback)
        return False  # never swallow an exception from the layers
