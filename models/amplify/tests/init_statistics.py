# Copied from common/tests/init_statistics.py — edit the source, then run ci/check_copies.py --fix
"""Does a freshly initialised model hold what its config says? One check for model tests and recipe tests alike.

Vectors are norm scales (ones) and biases (zeros); matrices are normal draws of ``initializer_range``, except where a
config switch says otherwise (Spike No More embeddings, depth-scaled output projections, MAGNETO's Xavier init). The
statistical bounds are sampling errors, so the check fails on a wrong std (say 20% off) yet passes every correct init
of a test-sized model.
"""

import math

import torch


def magneto_init(name: str, shape: tuple, config: dict) -> float | list:
    """MAGNETO (CodonFM's Encodon, ``init_scheme: "magneto"``): every linear weight is Xavier-normal, std = gain *
    sqrt(2 / (fan_in + fan_out)) with gain = initializer_range * sqrt(log(2 * layers)), except the query and key
    projections (gain 1); the embedding is normal(initializer_range) with the padding row zero.

    The fused QKV weight (TE's interleaved rows: per head its query, key and value rows) is checked block by block, as
    the three [hidden, hidden] linears it stands for; the MLM decoder's fan-out is the unpadded vocabulary."""
    gain = config["initializer_range"] * math.sqrt(math.log(2 * config["num_hidden_layers"]))
    if name.endswith("word_embeddings.weight"):
        pad = config["pad_token_id"]
        rows = torch.arange(shape[0])
        return [(rows[rows != pad], config["initializer_range"]), (rows[rows == pad], "zeros")]
    if name.endswith("self_attention.layernorm_qkv.weight"):
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        block_of_row = torch.arange(shape[0]).view(heads, 3, -1)  # [head, query/key/value, head_dim]
        query_key, value = 1.0 / math.sqrt(hidden), gain / math.sqrt(hidden)  # fan_in = fan_out = hidden
        return [
            (block_of_row[:, block].reshape(-1), std) for block, std in ((0, query_key), (1, query_key), (2, value))
        ]
    fan_out = config["vocab_size"] if name.endswith("decoder.weight") else shape[0]
    return gain * math.sqrt(2 / (shape[1] + fan_out))


def expected_init(name: str, shape: tuple, config: dict) -> float | str | list:
    """ "ones", "zeros", or the std a fresh matrix ``name`` of ``shape`` should have under ``config`` (a dict); or, for
    a matrix whose rows follow different rules, a list of (row indices, "zeros" or std)."""
    if ".contact_head." in name:
        return "zeros"  # ESM-2's contact regression (buffers, not trained here)
    if len(shape) == 1:
        return "zeros" if name.endswith("bias") else "ones"
    if config.get("init_scheme") == "magneto":
        return magneto_init(name, shape, config)
    if name.endswith("embed_tokens.weight") and config.get("embedding_init_std") is not None:
        return config["embedding_init_std"]  # Spike No More
    if name.endswith(("self_attention.proj.weight", "fc2_weight")) and config.get("scale_output_projection_init"):
        return config["initializer_range"] / (2 * config["num_hidden_layers"]) ** 0.5  # depth-scaled output init
    return config["initializer_range"]


def assert_initialised_as_configured(weights: dict[str, torch.Tensor], config, ranks: int = 1) -> None:
    """Every weight as ``config`` (a model config or its dict) describes it; with ``ranks`` > 1 (FSDP2 gives rank r
    the r-th chunk of dim 0), no two ranks' shards of a matrix are equal."""
    config = config if isinstance(config, dict) else config.to_dict()
    for name, tensor in weights.items():
        tensor = tensor.detach().float().cpu()
        expected = expected_init(name, tuple(tensor.shape), config)
        blocks = expected if isinstance(expected, list) else [(slice(None), expected)]
        for rows, block_expected in blocks:
            _assert_drawn_as(tensor[rows], block_expected, name)
        if not isinstance(expected, str):
            shards = tensor.chunk(ranks)
            for i in range(len(shards)):
                for j in range(i + 1, len(shards)):
                    assert not torch.equal(shards[i], shards[j]), f"{name}: ranks {i} and {j} hold identical shards"


def _assert_drawn_as(tensor: torch.Tensor, expected: float | str, name: str) -> None:
    if expected == "ones":
        assert torch.all(tensor == 1), name
    elif expected == "zeros":
        assert torch.all(tensor == 0), name
    else:
        # The sample std of n normal draws has a relative standard error of 1/sqrt(2n); allow 5 of them.
        tolerance = 5 / (2 * tensor.numel()) ** 0.5
        assert abs(tensor.std().item() / expected - 1) < tolerance, (name, tensor.std().item(), expected)
        assert abs(tensor.mean().item()) < 5 * expected / tensor.numel() ** 0.5, (name, tensor.mean().item())
        assert tensor.abs().max().item() < 10 * expected, (name, tensor.abs().max().item())
        assert torch.count_nonzero(tensor.abs().sum(-1) == 0) == 0, f"{name}: rows left uninitialised"
