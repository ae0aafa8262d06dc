# Copied from common/weight_conversion.py — edit the source, then run ci/check_copies.py --fix
"""What every conversion between a stock Hugging Face model and its TE twin needs, whatever the model.

- TE's fused QKV layout (``fuse_qkv_params=True``, interleaved): for each key/value group, the group's query heads,
  then its key head, then its value head. Multi-head attention is the case of one group per head. Works for weights
  (``[rows, hidden]``) and biases (``[rows]``) alike.
- Vocabulary padding: TE models pad embedding rows (and LM-head rows or biases) to a multiple that suits the GPU;
  padded rows are zeros and never reach the outputs.
- Loading with named errors: a conversion that misses a weight, invents one or gets a shape wrong says which.
- Config translation: the stock config and the TE config share every field except the TE-only ones.
"""

import torch


# Config fields only the TE models have (or that name the class), left out when translating to the stock config:
# the backend, vocabulary padding and FP8 plan, the fused-kernel and recompute switches, Llama's init switches.
NV_ONLY_CONFIG_KEYS = (
    "backend",
    "padded_vocab_size",
    "layer_precision",
    "auto_map",
    "architectures",
    "model_type",
    "recompute_layers",
    "fused_qkv_rope",
    "fused_residual_norm",
    "embedding_init_std",
    "scale_output_projection_init",
)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Separate Q ``[heads * d, ...]``, K and V ``[groups * d, ...]`` -> TE's fused ``[(heads + 2 groups) * d, ...]``."""
    if q.shape[0] % num_groups or k.shape[0] % num_groups or k.shape != v.shape:
        raise ValueError(f"cannot group Q {tuple(q.shape)}, K {tuple(k.shape)}, V {tuple(v.shape)} into {num_groups}")
    tail = q.shape[1:]
    per_group = [t.reshape(num_groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *tail)


def split_qkv(fused: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`interleave_qkv`: TE's fused QKV rows -> Q, K, V."""
    rows_per_head, remainder = divmod(fused.shape[0], num_heads + 2 * num_groups)
    if remainder or num_heads % num_groups:
        raise ValueError(f"{fused.shape[0]} fused rows do not hold {num_heads} query and {num_groups} key/value heads")
    tail = fused.shape[1:]
    per_group = fused.reshape(num_groups, num_heads // num_groups + 2, rows_per_head, *tail)
    q, k, v = per_group.split([num_heads // num_groups, 1, 1], dim=1)
    return tuple(t.reshape(-1, *tail) for t in (q, k, v))


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (vocabulary padding)."""
    if tensor.shape[0] > rows:
        raise ValueError(f"cannot pad {tensor.shape[0]} rows down to {rows}")
    padded = tensor.new_zeros(rows, *tensor.shape[1:])
    padded[: tensor.shape[0]] = tensor
    return padded


def load_state_dict_exactly(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model``; every key must exist with the same shape, and every weight must be given.

    TE's ``_extra_state`` (FP8 bookkeeping) keeps the model's own value when the source has none. ``source`` names
    where the weights came from, for the error message.
    """
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state and not k.endswith("_extra_state"))
    unexpected = sorted(k for k in state if k not in expected)
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state.items()
        if k in expected and not k.endswith("_extra_state") and v.shape != expected[k].shape
    ]
    problems = [
        f"{label} ({len(keys)}): {keys[:5]}{' ...' if len(keys) > 5 else ''}"
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", mismatched))
        if keys
    ]
    if problems:
        raise ValueError(f"cannot load {source}: " + "; ".join(problems))
    model.load_state_dict({**expected, **state}, strict=True)


def translate_config(config, target_class, drop: tuple[str, ...] = (), **overrides):
    """``target_class`` built from ``config``'s fields (minus ``drop`` and the class-naming ones) and ``overrides``."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "auto_map", *drop)}
    values.update(overrides)
    return target_class(**values)
