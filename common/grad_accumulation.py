"""How the micro-batches of one optimizer step are weighted: by their share of the scored tokens.

An optimizer step over micro-batches ``b_1 .. b_k`` should take the gradient of the mean loss over all their scored
tokens, exactly as one batch holding them all would. Each micro-batch's loss is already the mean over its own
``n_i`` scored tokens, so it is weighted by ``n_i / sum(n)``. (Dividing by ``k`` instead over-weights the tokens of
short micro-batches, which packing and masking make common.) Micro-batches with no scored token contribute nothing;
if none has any, the weights are equal so the step stays well defined.
"""


def token_weights(scored_tokens: list[int]) -> list[float]:
    """Each micro-batch's weight, given how many tokens each one scores."""
    if not scored_tokens:
        raise ValueError("token_weights needs at least one micro-batch")
    total = sum(scored_tokens)
    if total == 0:
        return [1 / len(scored_tokens)] * len(scored_tokens)
    return [count / total for count in scored_tokens]
