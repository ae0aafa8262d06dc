"""torchrun worker for test_pretrained_weights.py: full weights into FSDP2 shards of uneven sizes.

Usage: pretrained_weights_worker.py <result_file>

A toy model with rows that do not split evenly over the ranks (33 and 7) is sharded with FSDP2 (each layer, then the
root) and wrapped once more under a ``module`` attribute, so its state dict keys carry the "module." prefix that
Megatron-FSDP's wrapper gives them. ``load_full_weights`` fills it from another model's full weights; rank 0 saves
the gathered result, whether the wrapper's own ``load_state_dict`` ran (Megatron-FSDP installs its compute weights from
that hook) and the error a checkpoint without one weight gives.
"""

import sys

import torch
import torch.distributed as dist
from distributed import cleanup_distributed, setup_distributed
from pretrained_weights import load_full_weights
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(33, 6)
        self.proj = torch.nn.Linear(6, 7)
        self.head = torch.nn.Linear(7, 3)


class Wrapper(torch.nn.Module):
    """Holds the model as ``.module`` (state dict keys "module.<name>"), as Megatron-FSDP's wrapper does."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.loads = 0
        self.register_load_state_dict_post_hook(lambda module, keys: setattr(self, "loads", self.loads + 1))


def main() -> None:
    result_file = sys.argv[1]
    setup_distributed()
    torch.manual_seed(1)
    source = Toy()
    full = {k: v.clone() for k, v in source.state_dict().items()}
    torch.manual_seed(2)  # other weights: a load that does nothing cannot pass
    model = Toy()
    for layer in (model.embed, model.proj, model.head):
        fully_shard(layer)
    fully_shard(model)
    wrapped = Wrapper(model)
    load_full_weights(wrapped, full, "the toy checkpoint")
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    local_rows = {k: v.to_local().shape[0] for k, v in model.state_dict().items()}
    try:
        load_full_weights(wrapped, {k: v for k, v in full.items() if k != "proj.bias"}, "the toy checkpoint")
        error = None
    except ValueError as caught:
        error = str(caught)
    if dist.get_rank() == 0:
        result = {"full": full, "gathered": gathered, "loads": wrapped.loads, "rows": local_rows, "error": error}
        torch.save(result, result_file)
    cleanup_distributed()


if __name__ == "__main__":
    main()
