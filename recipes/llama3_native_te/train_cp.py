"""Context-parallel pre-training (each window split over ``cp_size`` GPUs, FSDP2 over all): NOT SUPPORTED YET.

    torchrun --nproc_per_node=2 train_cp.py --config-name L0_sanity_cp    # exits with the reason below

The Llama model in models/llama3 has ``set_context_parallel_group`` (it hands the group to TransformerEngine's
attention), but its forward cannot take context-parallel shards yet:

- it checks that ``cu_seq_lens_q`` ends at the number of tokens it was given, while a CP rank holds only its
  ``1 / cp_size`` load-balanced share of every sequence (chunks r and 2*cp-1-r) next to the global boundaries;
- it shifts labels for next-token prediction inside each contiguous sequence, which is wrong on a shard whose
  neighbouring tokens live on another rank (the collator would have to shift them before sharding);
- rotary positions are computed for unsharded sequences;
- its loss is the mean over the rank's own labels, not reduced over the CP group.

This script stops with that explanation instead of training a model that silently learns the wrong thing. When
the model advertises ``supports_context_parallel = True``, follow ``recipes/esm2_native_te/train_cp.py``: a (dp, cp)
mesh from ``distributed.build_meshes(..., cp_size)``, the CP group handed to the model, CP-sharded THD batches.
Until then use train_fsdp2.py (8,192-token windows of the 1B and 8B shapes fit one H100 with FSDP2).
"""

import hydra
from modeling_llama_te import NVLlamaForCausalLM
from omegaconf import DictConfig, OmegaConf


UNSUPPORTED = (
    "train_cp.py: context parallelism is not supported by the Llama model yet (models/llama3: its forward takes "
    "whole sequences only; see this script's docstring). Train with train_fsdp2.py instead."
)


def check_context_parallel_support(cfg: DictConfig) -> None:
    """Fail before any process group or GPU work when this run asks for something that cannot train correctly."""
    if cfg.cp_size < 2:
        raise ValueError(f"train_cp.py needs cp_size >= 2 (got {cfg.cp_size}); for cp_size=1 use train_fsdp2.py")
    if not getattr(NVLlamaForCausalLM, "supports_context_parallel", False):
        raise NotImplementedError(UNSUPPORTED)


@hydra.main(config_path="hydra_config", config_name="L0_sanity_cp", version_base="1.3")
def main(cfg: DictConfig) -> None:
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a missing `???` value fails here, by name
    check_context_parallel_support(cfg)
    raise NotImplementedError(UNSUPPORTED)  # unreachable until the model supports CP and this loop is written


if __name__ == "__main__":
    main()
