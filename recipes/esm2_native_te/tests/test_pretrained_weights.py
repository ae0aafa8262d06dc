"""load_full_weights (pretrained_weights.py): full weights into a sharded model, each rank its own part."""

import torch
from launch import run_script


def test_full_weights_land_in_uneven_shards_exactly(tmp_path):
    """Two gloo processes, FSDP2 shards of 17 + 16 and 4 + 3 rows under a "module." wrapper (Megatron-FSDP's key
    prefix): gathered back, the model holds exactly the given weights; the wrapper's load_state_dict ran; a
    checkpoint without one weight is refused with its name."""
    result_file = tmp_path / "result.pt"
    run_script("tests/pretrained_weights_worker.py", str(result_file), nproc=2)
    result = torch.load(result_file, weights_only=True)
    assert result["rows"]["embed.weight"] == 17 and result["rows"]["proj.weight"] == 4  # rank 0's share: uneven
    assert result["gathered"].keys() == result["full"].keys()
    for key, value in result["full"].items():
        assert torch.equal(result["gathered"][key], value), key
    assert result["loads"] == 1
    assert result["error"] == "cannot load the toy checkpoint: missing keys (1): ['proj.bias']"
