"""``PackedBatch.next_token_labels``: the causal-LM loss's targets, for every input layout, without a host sync.

The reference below works on the caller's own layout (rows of a padded batch, or the sequences of a THD batch) and
knows nothing of the packing, so it checks the shift, the end-of-sequence masking and the alignment padding."""

import pytest
import torch

from llama3_te.packing import IGNORE_INDEX, pack_inputs


PAD = 0


def _reference_thd(labels: torch.Tensor, cu_seqlens: list[int]) -> list[int]:
    flat = labels.reshape(-1).tolist()
    out = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out += flat[start + 1 : end] + [IGNORE_INDEX] * (end > start)
    return out


def _reference_bshd(labels: torch.Tensor, mask: torch.Tensor) -> list[int]:
    out = []
    for row, keep in zip(labels.tolist(), mask.bool().tolist()):
        real = [value for value, k in zip(row, keep) if k]
        out += real[1:] + [IGNORE_INDEX] * bool(real)
    return out


def _cases(device: str):
    """(name, pack_inputs arguments, align_to, labels, reference) for THD (with empty sequences), right- and
    left-padded BSHD, with and without the alignment padding that FP8 asks for."""
    g = torch.Generator().manual_seed(0)
    cu = [0, 0, 3, 4, 4, 9, 16]  # empty sequences (first and inside) end "before" their start
    thd_ids = torch.randint(1, 20, (1, cu[-1]), generator=g)
    thd_labels = torch.randint(1, 20, (1, cu[-1]), generator=g)
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    left = right.flip(1)
    bshd_ids = torch.randint(1, 20, right.shape, generator=g)
    bshd_labels = torch.randint(1, 20, right.shape, generator=g)
    for align_to in (1, 16):
        cu_tensor = torch.tensor(cu, dtype=torch.int32, device=device)
        yield (
            f"thd-align{align_to}",
            (thd_ids.to(device), None, cu_tensor, cu_tensor, max(b - a for a, b in zip(cu, cu[1:]))),
            align_to,
            thd_labels.to(device),
            _reference_thd(thd_labels, cu),
        )
        for name, mask in (("right", right), ("left", left)):
            ids = bshd_ids.masked_fill(mask == 0, PAD)
            yield (
                f"bshd-{name}-align{align_to}",
                (ids.to(device), mask.to(device), None, None, None),
                align_to,
                bshd_labels.to(device),
                _reference_bshd(bshd_labels, mask),
            )


def _next_token_labels(arguments, align_to, labels) -> torch.Tensor:
    packed = pack_inputs(*arguments, pad_token_id=PAD, align_to=align_to)
    return packed.next_token_labels(labels)


@pytest.mark.parametrize("case", list(_cases("cpu")), ids=lambda case: case[0])
def test_next_token_labels_match_the_per_sequence_shift(case):
    _, arguments, align_to, labels, reference = case
    targets = _next_token_labels(arguments, align_to, labels)
    real = len(reference)
    assert targets[:real].tolist() == reference
    # alignment padding (a pseudo-sequence appended to reach a multiple of align_to) is never scored
    assert (targets[real:] == IGNORE_INDEX).all()
    assert targets.shape[0] % align_to == 0


def test_a_sequence_that_ends_the_packed_labels_is_not_shifted_into_the_padding():
    """The last real token's target is IGNORE_INDEX, also when alignment padding follows it."""
    ids = torch.randint(1, 20, (1, 5))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    targets = _next_token_labels((ids, None, cu, cu, 3), 16, ids)
    assert targets[:5].tolist() == [ids[0, 1].item(), IGNORE_INDEX, ids[0, 3].item(), ids[0, 4].item(), IGNORE_INDEX]


@pytest.mark.requires_gpu
def test_next_token_labels_do_not_synchronise_with_the_gpu():
    """On CUDA the targets come without a host sync (torch raises on one in sync debug mode "error"; a boolean-mask
    index would be a nonzero()), and equal the reference."""
    for name, arguments, align_to, labels, reference in _cases("cuda"):
        packed = pack_inputs(*arguments, pad_token_id=PAD, align_to=align_to)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            targets = packed.next_token_labels(labels)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert targets[: len(reference)].tolist() == reference, name
        assert (targets[len(reference) :] == IGNORE_INDEX).all(), name
