"""Pre-train ESM-2 or AMPLIFY (``model_tag``) with the Hugging Face Trainer, launched by ``accelerate launch``.

    accelerate launch --config_file accelerate_config/cpu.yaml train.py                      # L0 sanity on CPU
    accelerate launch --config_file accelerate_config/fsdp2_te.yaml --num_processes 8 train.py --config-name L1_650M
    accelerate launch --config_file accelerate_config/fp8.yaml --num_processes 8 train.py --config-name L1_650M

The accelerate config file decides processes, DDP or FSDP2, and precision (bf16 or FP8); the Hydra config (every key
in hydra_config/defaults.yaml) decides model, data, optimizer, checkpoints. Reads top to bottom: launch settings,
Trainer arguments (they start torch.distributed), the checkpoint to resume (checkpoints.py; a launch that would mix two
runs in output_dir stops there), model, data, Trainer with callbacks, data position, train, export.
"""

import logging
from pathlib import Path

import hydra
from callbacks import DataPositionCallback, FinalCheckpointCallback, PerfCallback, StopAfterStepsCallback
from checkpoints import checkpoint_step, restore_data_position, resume_checkpoint
from dataset import create_dataloader
from export import export_final_model
from fp8_calibration import uses_delayed_scaling
from launch_settings import (
    LaunchSettings,
    check_launch,
    fp8_config_from_accelerate,
    gpu_capability,
    hand_fp8_to_the_model,
)
from mlm_trainer import MaskedLMTrainer
from model_families import load_tokenizer
from model_setup import build_model
from omegaconf import DictConfig, OmegaConf
from perf_logger import PerfLogger, quiet_progress_bars_off_a_terminal
from recipe_paths import config_name
from training_arguments import training_arguments
from transformers import PrinterCallback, set_seed
from user_errors import check_config, report_user_errors


logger = logging.getLogger(__name__)


@report_user_errors(hydra.main(config_path="hydra_config", config_name="L0_sanity", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)  # a `???` value left unset or a mistyped override (num_train_steps=abc) fails here, by name
    quiet_progress_bars_off_a_terminal()  # in a log file a bar is one endless line
    launch = LaunchSettings.from_environment()
    check_launch(launch, cfg, gpu_capability())
    fp8_config = fp8_config_from_accelerate(launch, cfg)
    if fp8_config["enabled"]:
        hand_fp8_to_the_model()  # the model runs FP8 per layer; the Trainer's accelerate sees bf16 only

    # TrainingArguments sets up torch.distributed (one process per GPU, or gloo on CPU) and the device.
    args = training_arguments(cfg, launch)
    if args.process_index != 0:
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Launch: %s on %d process(es), %s", launch.describe(), args.world_size, args.device)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    # Before anything is built or written: a launch that would mix its checkpoints with another run's stops here.
    resume_from = resume_checkpoint(cfg.checkpoint.resume, cfg.checkpoint.resume_from, cfg.output_dir)
    set_seed(cfg.seed)  # the same random init on every process

    tokenizer = load_tokenizer(cfg)  # the model family's, with tokenizer_path: auto
    built = build_model(cfg, fp8_config, args.device)
    if args.gradient_checkpointing:  # the Trainer calls the model's gradient_checkpointing_enable()
        logger.info("Activations recomputed in backward: every layer (training_args.gradient_checkpointing)")
    elif getattr(built.config, "recompute_layers", 0):
        logger.info(
            "Activations recomputed in backward: the first %d of %d layers (recompute_layers)",
            built.config.recompute_layers,
            built.config.num_hidden_layers,
        )
    data_cfg = OmegaConf.to_container(cfg.dataset)
    if fp8_config["enabled"] and not data_cfg["pad_to_multiple_of"]:
        data_cfg["pad_to_multiple_of"] = 16  # FP8 GEMMs need token counts that are multiples of 16
    dataloader = create_dataloader(
        data_cfg, tokenizer, dp_rank=args.process_index, dp_world_size=args.world_size, seed=cfg.seed
    )

    start_step = 0
    if resume_from is not None:
        restore_data_position(resume_from, dataloader, args.process_index, args.world_size)
        start_step = checkpoint_step(resume_from)
        logger.info("Resuming from %s (step %d)", resume_from, start_step)

    perf = PerfLogger(cfg, built.model_flops, tokenizer.pad_token_id, start_step, config_name=config_name())
    trainer = MaskedLMTrainer(
        model=built.model,
        args=args,
        train_dataloader=dataloader,
        lr_scheduler_kwargs=cfg.lr_scheduler_kwargs,
        perf=perf,
        processing_class=tokenizer,
        # Under FSDP2 the layers already compute in bf16 (FSDP2 casts the fp32 weights, as in the native recipe's
        # train_fsdp2.py); accelerate's autocast on top would only add per-op overhead. DDP needs it for bf16.
        autocast=not (launch.fsdp and cfg.model_implementation == "nv"),
        calibrate_fp8_scales=cfg.calibrate_delayed_scaling and uses_delayed_scaling(built.plan.fp8_recipe),
    )
    trainer.remove_callback(PrinterCallback)  # PerfCallback prints one line per logging step instead
    trainer.add_callback(PerfCallback(trainer, perf, cfg.logger.log_every, fp8_requested=fp8_config["enabled"]))
    trainer.add_callback(StopAfterStepsCallback(cfg.stop_after_steps))
    if cfg.checkpoint.save_final:
        trainer.add_callback(FinalCheckpointCallback())
    trainer.add_callback(DataPositionCallback(dataloader, cfg.checkpoint.max_checkpoints))

    # A launch that finds its run already finished loads the last checkpoint, trains nothing and exports again.
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)

    if cfg.export_final_model and trainer.state.global_step >= cfg.num_train_steps:
        # A Hugging Face directory that loads anywhere (AutoModelForMaskedLM, trust_remote_code), without FP8.
        export_final_model(trainer, built.model, Path(cfg.output_dir) / "final_model", tokenizer)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
