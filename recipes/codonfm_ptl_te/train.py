"""Pre-train Encodon on coding sequences (masked-codon LM), or fine-tune it with a sequence-level head, with PyTorch
Lightning and TransformerEngine.

    python train.py                                                   # L0 sanity: learns on CPU in about a minute
    python train.py --config-name L0_finetune                         # a regression head on a synthetic label
    torchrun --nproc_per_node=8 train.py --config-name encodon_600m data.train_path=/data/orfs.parquet
    torchrun --nproc_per_node=8 train.py --config-name encodon_1b data.train_path=... strategy=fsdp2 \
        fp8_config.enabled=true

Reads top to bottom: the LightningModule (model config and FP8 plan; the model itself is built in its
``configure_model``), the LightningDataModule, the Trainer (strategy, precision, checkpoint IO, callbacks:
trainer_setup.py), then ``fit``, resuming from ``last.ckpt`` when the output directory has one (a launch that would
start afresh among an earlier run's checkpoints is refused first: checkpoint_io.resume_checkpoint). The export to
``<output_dir>/final_model`` happens in a callback at the end of training. Every key is documented in
hydra_config/defaults.yaml.
"""

import logging
import os

import hydra
import lightning as L
from checkpoint_io import resume_checkpoint
from datamodule import CodonDataModule
from lightning_module import module_for
from omegaconf import DictConfig, OmegaConf
from perf_logger import quiet_progress_bars_off_a_terminal
from recipe_paths import config_name
from trainer_setup import build_trainer, end_run, quiet_lightning
from user_errors import check_config, report_user_errors


logger = logging.getLogger(__name__)


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)  # a `???` value left unset or a mistyped override (num_train_steps=abc) fails here, by name
    quiet_progress_bars_off_a_terminal()  # in a log file a bar is one endless line
    quiet_lightning()
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    # A relaunch continues from the newest complete checkpoint: weights, optimizer, schedule, step, data position. A
    # launch that would start afresh among an earlier run's checkpoints stops here, before anything is built, as does
    # one whose checkpoint has one optimizer parameter group (written before the weight decay groups).
    ckpt_path = resume_checkpoint(cfg.checkpoint.ckpt_dir, cfg.checkpoint.resume)
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # the same initial weights on every rank

    # The model's config, FP8 plan and (fine-tuning) starting weights; the model is built in configure_model, once
    # the strategy knows the device and, for FSDP2, the device mesh.
    module = module_for(cfg)
    data = CodonDataModule(cfg.data)
    trainer = build_trainer(cfg, config_name())
    module.check_hardware(trainer.strategy.root_device)

    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    end_run()  # multi-process CPU runs leave before the interpreter's teardown (trainer_setup.end_run)


if __name__ == "__main__":
    main()
