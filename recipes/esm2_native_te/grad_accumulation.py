# Copied from common/grad_accumulation.py — edit the source, then run ci/check_copies.py --fix
"""How the micro-batches of one optimizer step are weighted: by their share of the scored tokens.

An optimizer step over micro-batches ``b_1 .. b_k`` should take the gradient of the mean loss over all their scored
tokens, exactly as one batch holding them all would. Each micro-batch's loss is already the mean over its own
``n_i`` scored tokens, so it is weighted by ``n_i / sum(n)``. (Dividing by ``k`` instead over-weights the tokens of
short micro-batches, which packing and masking make common.) Micro-batches with no scored token contribute nothing;
if none has any, the weights are equal so the step stays well defined.

The same holds across data-parallel ranks (``step_token_weights``): DDP and FSDP average the ranks' gradients, so
with ``n_i * dp / N``, ``N`` counted over every DP rank's micro-batches of the step, the step's gradient is the mean
over all of its scored tokens, however they are split over ranks and micro-batches (2 ranks x 1 micro-batch = 1
rank x 2). With each rank's own ``n_i / sum(n)`` a token on a rank that drew few scored tokens would weigh more.

Count on the full batches, before any context-parallel split, so every rank of a CP group uses the same weights.
"""

import torch
import torch.distributed as dist


IGNORE_INDEX = -100


def count_targets(batch: dict, causal_lm: bool) -> int:
    """Tokens the model scores in ``batch`` (BSHD padded on the right, THD, or a full context-parallel batch).

    Masked LM scores every labelled token. A causal LM predicts token i from the tokens before it, so the first
    label of each sequence is never a target; a context-parallel batch already holds its shifted targets.
    """
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    scored = batch["labels"] != IGNORE_INDEX
    if causal_lm and "cu_seq_lens_q" in batch:  # THD: one row, sequences start at cu_seq_lens_q[:-1]
        scored[0, batch["cu_seq_lens_q"][:-1].long()] = False
    elif causal_lm:  # BSHD: each row is one sequence, its padding on the right
        scored[:, 0] = False
        if "attention_mask" in batch:
            scored &= batch["attention_mask"].bool()
    return int(scored.sum())


def token_weights(scored_tokens: list[int]) -> list[float]:
    """Each micro-batch's weight, given how many tokens each one scores."""
    if not scored_tokens:
        raise ValueError("token_weights needs at least one micro-batch")
    total = sum(scored_tokens)
    if total == 0:
        return [1 / len(scored_tokens)] * len(scored_tokens)
    return [count / total for count in scored_tokens]


def step_token_weights(scored_tokens: list[int], device: torch.device, dp_group=None) -> list[float | torch.Tensor]:
    """Each micro-batch's weight in a step that the data-parallel ranks share: ``n_i * dp / N``, with ``N`` the
    step's scored tokens over all DP ranks (one all-reduce of one number, left on ``device``: no host sync).

    ``dp_group`` is the group across DP ranks; None means every process (DDP, Megatron-FSDP), or none without a process
    group. Context-parallel ranks of one DP group count the same full batches, so under CP it is the ``dp`` mesh's
    group, not the world. With one DP rank this is ``token_weights``."""
    if dp_group is None and dist.is_initialized():
        dp_group = dist.group.WORLD
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return token_weights(scored_tokens)
    # torch.full writes the count with a kernel; torch.tensor would copy it from the host and wait for the GPU.
    total = torch.full((), float(sum(scored_tokens)), device=device)
    dist.all_reduce(total, group=dp_group)
    scale = dist.get_world_size(dp_group) / total.clamp(min=1)
    return [count * scale for count in scored_tokens]
