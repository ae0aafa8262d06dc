"""The ``lightning.Trainer`` of a run: processes, strategy, precision, checkpoint IO and callbacks, from the config.

- **Processes.** ``python train.py`` on one device; ``torchrun --nproc_per_node=N train.py`` (Lightning reads
  torchrun's variables); ``srun`` with one task per GPU on SLURM (slurm.sh). With ``trainer.devices: auto`` and
  ``trainer.num_nodes: auto`` the counts come from the launcher, so the command line never repeats them.
- **Strategy** (``strategy``): ``ddp`` (Lightning's ``DDPStrategy``; one device: no wrapper at all), ``fsdp``
  (``FSDPStrategy``, FSDP1, each ``EncodonLayer`` one unit via the auto-wrap policy; CUDA only) or ``fsdp2``
  (``ModelParallelStrategy``: the LightningModule's ``configure_model`` calls ``fully_shard`` per layer, on CPU too).
- **Precision** (``trainer.precision``): ``bf16-mixed`` is Lightning's own: ``torch.autocast(bf16)`` over fp32
  weights. The sharded strategies also gather their weight shards in bf16 and reduce gradients in fp32 (FSDP2's
  ``MixedPrecisionPolicy`` from mixed_precision.py; FSDP1's ``MixedPrecision`` with the same dtypes). Neither casts
  buffers or forward inputs: the rotary table stays float32 (bf16 would put positions in the thousands whole radians
  off). ``32-true`` is plain float32 (CPU runs). FP8 is not a Lightning precision: the model runs its FP8 layers in
  its own ``te.autocast``, one per run of same-precision layers (``fp8_config``; layer_autocast.py), inside
  Lightning's bf16 autocast, so the first and last layers and the MLM head can stay in bf16. Lightning's
  ``TransformerEnginePrecision`` plugin is not used: it would swap ``nn.Linear`` for TE layers and put the whole
  forward, head included, under one FP8 recipe.
- **Checkpoints**: Lightning's ``ModelCheckpoint`` written through :class:`checkpoint_io.AtomicCheckpointIO`.
"""

import logging
import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
from callbacks import ExportCallback, PerfCallback, PerRankDataPosition
from checkpoint_io import AtomicCheckpointIO, RecipeModelCheckpoint, extra_state_kept_when_absent
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from model_setup import fsdp_unit
from omegaconf import DictConfig, OmegaConf
from user_errors import ConfigError, UnsupportedHardwareError


logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp", "fsdp2")
PRECISIONS = ("bf16-mixed", "32-true")
# Trainer arguments this recipe sets from other keys; the `trainer` config group may not set them again.
MANAGED = ("strategy", "plugins", "callbacks", "logger", "max_steps", "max_epochs", "enable_progress_bar",
           "default_root_dir", "use_distributed_sampler", "check_val_every_n_epoch", "gradient_clip_val")  # fmt: skip


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def quiet_lightning() -> None:
    """Drop output nobody using this recipe can act on: Lightning's advertising tip, its pytree deprecation warning
    under torch 2.13, and FSDP2's warning that the model returns views (nothing here modifies outputs in place)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def end_run() -> None:
    """End a finished run's process. Multi-process CPU runs (gloo): every rank meets at a barrier, the group is
    destroyed, the logs are flushed and the process leaves with ``os._exit(0)``. Otherwise: return normally.

    Call it last, once ``fit`` or ``predict`` has written every output (the callbacks close their files at the end of
    training). A two-process FSDP2 CPU run in CI aborted after its export, in the interpreter's teardown ("terminate
    called without an active exception", no Python frame left): there Lightning's atexit hook destroys the process
    group without a barrier, and the group's C++ objects are freed in no fixed order. The native recipes leave gloo
    runs the same way before that teardown (``cleanup_distributed`` in their distributed.py). NCCL runs (GPUs) keep
    Lightning's own ending.
    """
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_backend() != "gloo":
        return
    distributed.barrier()  # a rank that left early would break the others' teardown
    distributed.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def process_counts(trainer_cfg: DictConfig) -> tuple[Any, int]:
    """``(devices, num_nodes)``: as configured, or, for ``auto``, what torchrun or SLURM started."""
    devices, num_nodes = trainer_cfg.devices, trainer_cfg.num_nodes
    if "LOCAL_WORLD_SIZE" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        launched = (
            int(os.environ["LOCAL_WORLD_SIZE"]),
            int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        )
    elif SLURMEnvironment.detect():  # srun: one task per device
        nodes = int(os.environ.get("SLURM_NNODES", "1"))
        launched = int(os.environ["SLURM_NTASKS"]) // nodes, nodes
    else:
        launched = None
    if devices == "auto":  # not Lightning's "every visible GPU": `python train.py` is one process, as in every recipe
        devices = launched[0] if launched is not None else 1
    if num_nodes == "auto":
        num_nodes = launched[1] if launched is not None else 1
    return devices, int(num_nodes)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (here FSDP2 only), resuming TE models from weights-only checkpoints."""

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        with extra_state_kept_when_absent(self.lightning_module):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


def build_strategy(cfg: DictConfig, accelerator: str, devices: Any, num_nodes: int):
    """The Lightning strategy named by ``cfg.strategy``."""
    name = cfg.strategy
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name}: choose one of {', '.join(STRATEGIES)}")
    if name == "fsdp" and OmegaConf.select(cfg, "model_config_overrides.recompute_layers", default=0):
        # FSDP1 wraps each layer in its own module; checkpointing around that wrapper has not been tested here.
        raise ConfigError(
            "model_config_overrides.recompute_layers is not supported with strategy=fsdp (FSDP1) yet: use "
            "strategy=fsdp2 or strategy=ddp for activation recompute"
        )
    if name == "fsdp":
        if accelerator == "cpu" or not torch.cuda.is_available():
            raise UnsupportedHardwareError(
                "strategy=fsdp (Lightning's FSDPStrategy) needs CUDA GPUs: use strategy=fsdp2 (ModelParallelStrategy, "
                "which also runs on CPU) or strategy=ddp here"
            )
        from torch.distributed.fsdp import MixedPrecision

        mixed = None
        if cfg.trainer.precision == "bf16-mixed":
            # Lightning's default for bf16-mixed casts buffers (the rotary inv_freq) and reduces in bf16.
            mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=None)
        return FSDPStrategy(
            auto_wrap_policy={fsdp_unit()},
            mixed_precision=mixed,
            sharding_strategy="FULL_SHARD" if cfg.fsdp.reshard_after_forward else "SHARD_GRAD_OP",
            state_dict_type="full",  # checkpoints are whole files, written through the CheckpointIO plugin
            limit_all_gathers=True,
        )
    if name == "fsdp2":
        total = devices * num_nodes if isinstance(devices, int) else None
        return FSDP2Strategy(
            data_parallel_size=total or "auto",  # every process one data-parallel rank: FSDP2 only, no TP
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,  # full checkpoints, written atomically by rank 0 (checkpoint_io.py)
        )
    if devices == 1 and num_nodes == 1:
        return "auto"  # one device: Lightning's SingleDeviceStrategy, no DDP wrapper
    return DDPStrategy(gradient_as_bucket_view=True)


def build_trainer(cfg: DictConfig, config_name: str = "") -> L.Trainer:
    """The Trainer for ``cfg``: see the module docstring."""
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    clash = sorted(set(trainer_kwargs) & set(MANAGED))
    if clash:
        raise ConfigError(f"trainer.{clash[0]} is set by this recipe from other keys; remove it (see defaults.yaml)")
    if trainer_kwargs["precision"] not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={trainer_kwargs['precision']}: choose one of {', '.join(PRECISIONS)} (FP8: "
            "fp8_config.enabled=true, on top of bf16-mixed)"
        )
    accelerator = trainer_kwargs.pop("accelerator")
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices, num_nodes = process_counts(cfg.trainer)
    trainer_kwargs.update(devices=devices, num_nodes=num_nodes)

    callbacks = [PerfCallback(cfg, config_name), PerRankDataPosition()]
    checkpoint = cfg.checkpoint
    if checkpoint.save_every or checkpoint.save_final:
        callbacks.append(
            RecipeModelCheckpoint(
                dirpath=checkpoint.ckpt_dir,
                save_every=checkpoint.save_every,
                keep=checkpoint.keep_step_checkpoints,
                save_final=checkpoint.save_final,
            )
        )
    if cfg.export_final_model:
        callbacks.append(ExportCallback(cfg))
    try:
        return L.Trainer(
            accelerator=accelerator,
            strategy=build_strategy(cfg, accelerator, devices, num_nodes),
            plugins=[AtomicCheckpointIO()],
            callbacks=callbacks,
            max_steps=cfg.num_train_steps,
            max_epochs=-1,  # the training data never ends (epochs roll over inside the sampler): steps decide
            check_val_every_n_epoch=None,  # validate every trainer.val_check_interval batches, across epochs
            logger=False,  # metrics.jsonl / summary.json / W&B come from PerfCallback (perf_logger.py)
            enable_progress_bar=False,  # PerfCallback shows one bar on a terminal and plain lines in a log
            enable_checkpointing=len([c for c in callbacks if isinstance(c, RecipeModelCheckpoint)]) > 0,
            default_root_dir=cfg.output_dir,
            use_distributed_sampler=False,  # the datamodule gives each data-parallel rank its own share
            **trainer_kwargs,
        )
    except (ValueError, MisconfigurationException) as error:  # Lightning's checks of devices, num_nodes, ...
        raise ConfigError(f"lightning.Trainer refused the trainer settings: {error}") from None
