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


class _WithExtraState(torch.nn.Linear):
    """A layer with an ``_extra_state`` entry in its state dict, as TE's layers have (FP8 bookkeeping)."""

    def get_extra_state(self):
        return torch.tensor([1.0])

    def set_extra_state(self, state):
        pass


def test_weights_on_the_host_keep_the_float32_initialisation_past_a_cast_to_bf16():
    """What Megatron-FSDP's build keeps before its cast to bf16: a float32 copy on the host, not aliasing the model's
    weights, without ``_extra_state``; loaded back (load_full_weights), the model holds its initialisation exactly."""
    from pretrained_weights import load_full_weights, weights_on_the_host

    torch.manual_seed(0)
    model = torch.nn.Sequential(_WithExtraState(16, 16), torch.nn.LayerNorm(16))
    initialisation = {key: value.clone() for key, value in model.state_dict().items() if "extra" not in key}
    kept = weights_on_the_host(model)
    assert kept.keys() == initialisation.keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    model.to(torch.bfloat16).float()  # the cast rounds the model's own weights for good
    assert not torch.equal(model[0].weight, initialisation["0.weight"])
    for key, value in initialisation.items():
        assert kept[key].device.type == "cpu" and kept[key].dtype == torch.float32
        assert torch.equal(kept[key], value), key
    load_full_weights(model, kept, "the float32 initialisation")
    for key, value in initialisation.items():
        assert torch.equal(model.state_dict()[key], value), key
