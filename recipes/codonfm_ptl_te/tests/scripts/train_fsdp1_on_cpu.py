"""train.py with strategy=fsdp (Lightning's FSDPStrategy, FSDP1) on CPU processes (gloo), recording each rank's
parameter shards before and after training, for tests/test_weight_decay.py.

    torchrun --nproc_per_node=2 tests/scripts/train_fsdp1_on_cpu.py output_dir=OUT strategy=fsdp [train.py overrides]

The recipe runs FSDP1 on GPUs only (trainer_setup.build_strategy refuses it on a CPU, as Lightning does), but torch's
FSDP1 itself runs on CPU processes when given the CPU as its device. Three stand-ins, here only, let train.py run it:

- ``FullyShardedDataParallel`` gets ``device_id=cpu`` where Lightning passes ``root_device.index`` (None on a CPU);
- the strategy is a subclass of ``FSDPStrategy`` (Lightning refuses the class itself without a GPU accelerator) with
  the recipe's settings for 32-true: each EncodonLayer one unit, FULL_SHARD, full state dicts;
- the Trainer gets a callback that, when training starts, sets every parameter that configure_model recorded as
  undecayed to random values around 1 (biases start at 0 and LayerNorm weights at 1, which would hide a decay), then
  writes ``OUT/rank<r>.pt``: this rank's parameters (each FSDP1's flat 1-D view of its shard, maybe empty) by their
  names as FSDP1 shows them, before the first step and after the last.

Run it without checkpoints and export (``checkpoint.save_final=false export_final_model=false``): gathering the full
state dict on CPU processes ended in a segmentation fault with torch 2.13 (FSDP1's GPU path is tested on GPUs).
"""

import runpy
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed.fsdp as fsdp
import trainer_setup
from lightning.pytorch.strategies import FSDPStrategy
from model_setup import fsdp_unit, name_before_wrapping


RECIPE_DIR = Path(__file__).resolve().parents[2]


class CPUFullyShardedDataParallel(fsdp.FullyShardedDataParallel):
    def __init__(self, module, *args, device_id=None, **kwargs):
        super().__init__(module, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU processes."""


class ShardRecorder(L.Callback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self.before: dict[str, torch.Tensor] = {}

    def local(self, pl_module) -> dict[str, torch.Tensor]:
        return {name: param.detach().clone() for name, param in pl_module.model.named_parameters()}

    def on_train_start(self, trainer, pl_module) -> None:
        generator = torch.Generator().manual_seed(trainer.global_rank)
        with torch.no_grad():
            for name, param in pl_module.model.named_parameters():
                if name_before_wrapping(name) in pl_module._no_weight_decay:
                    param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        self.before = self.local(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        record = {"before": self.before, "after": self.local(pl_module), "strategy": type(trainer.strategy).__name__}
        torch.save(record, self.output_dir / f"rank{trainer.global_rank}.pt")


def build_strategy(cfg, accelerator, devices, num_nodes):
    assert cfg.strategy == "fsdp" and cfg.trainer.precision == "32-true", "FSDP1 in float32 on CPU processes only"
    return CPUFSDPStrategy(auto_wrap_policy={fsdp_unit()}, sharding_strategy="FULL_SHARD", state_dict_type="full")


def build_trainer(cfg, config_name: str = ""):
    trainer = build_recipe_trainer(cfg, config_name)
    trainer.callbacks.append(ShardRecorder(cfg.output_dir))
    return trainer


fsdp.FullyShardedDataParallel = CPUFullyShardedDataParallel  # what Lightning's FSDPStrategy imports when it wraps
trainer_setup.build_strategy = build_strategy
build_recipe_trainer, trainer_setup.build_trainer = trainer_setup.build_trainer, build_trainer
sys.argv[0] = str(RECIPE_DIR / "train.py")
runpy.run_path(str(RECIPE_DIR / "train.py"), run_name="__main__")
