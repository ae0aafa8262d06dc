# Copied from common/grad_accumulation.py — edit the source, then run ci/check_copies.py --fix
"""How the micro-batches of one optimizer step are weighted: by their share of the scored tokens.

An optimizer step over micro-batches ``b_1 .. b_k`` should take the gradient of the mean loss over all their scored
tokens, exactly as one batch holding them all would. Each micro-batch's loss is already the mean over its own
``n_i`` scored tokens, so it is weighted by ``n_i / sum(n)``. (Dividing by ``k`` instead over-weights the tokens of
short micro-batches, which packing and masking make common.) Micro-batches with no scored token contribute nothing;
if none has any, the weights are equal so the step stays well defined.

Count on the full batches, before any context-parallel split, so every rank of a CP group uses the same weights.
"""

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
