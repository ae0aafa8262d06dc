"""The DelayedScaling calibration passes inside the Hugging Face Trainer (mlm_trainer.py), on the CPU.

FP8 cannot run here, so the passes are forced on (as an FP8 DelayedScaling launch turns them on) and find no FP8
scale to set: what this checks is the Trainer side. The passes run the Trainer's own forward and backward of the
launch's first micro-batch and leave no trace: the same losses and gradient norms as a run without them, with
dropout on and two micro-batches per step (their gradients are discarded before the first one trains). The GPU test
(tests/test_train_gpu.py::test_fp8_on_chosen_layers_runs_fp8_only_there) checks that they set the FP8 scales.
"""

import json
import logging

from callbacks import PerfCallback
from dataset import create_dataloader
from hydra import compose, initialize_config_dir
from launch import RECIPE_DIR
from launch_settings import LaunchSettings, fp8_config_from_accelerate
from mlm_trainer import MaskedLMTrainer
from model_families import load_tokenizer
from model_setup import build_model
from omegaconf import OmegaConf
from perf_logger import PerfLogger
from training_arguments import training_arguments
from transformers import PrinterCallback, set_seed


def train_three_steps(output_dir, calibrate: bool) -> list[dict]:
    """train.py's assembly on one CPU process, in this one, for three steps logged every step."""
    overrides = [
        f"output_dir={output_dir}",
        "num_train_steps=3",
        "grad_acc_steps=2",
        "logger.log_every=1",
        "checkpoint.save_final=false",
        "export_final_model=false",
        "+model_config_overrides.hidden_dropout_prob=0.1",  # a shifted random stream would show in the losses
    ]
    with initialize_config_dir(config_dir=str(RECIPE_DIR / "hydra_config"), version_base="1.3"):
        cfg = compose(config_name="L0_sanity", overrides=overrides)
    launch = LaunchSettings(precision="no", fsdp=False, fsdp_layer_class=None, use_cpu=True, launched=False)
    args = training_arguments(cfg, launch)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg)
    built = build_model(cfg, fp8_config_from_accelerate(launch, cfg), args.device)
    dataloader = create_dataloader(
        OmegaConf.to_container(cfg.dataset), tokenizer, dp_rank=0, dp_world_size=1, seed=cfg.seed
    )
    perf = PerfLogger(cfg, built.model_flops, tokenizer.pad_token_id, 0, config_name="L0_sanity")
    trainer = MaskedLMTrainer(
        model=built.model,
        args=args,
        train_dataloader=dataloader,
        lr_scheduler_kwargs=cfg.lr_scheduler_kwargs,
        perf=perf,
        processing_class=tokenizer,
        calibrate_fp8_scales=calibrate,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(PerfCallback(trainer, perf, 1, fp8_requested=False))
    trainer.train()
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_calibration_passes_leave_the_trainers_run_unchanged(tmp_path, caplog):
    plain = train_three_steps(tmp_path / "plain", calibrate=False)
    with caplog.at_level(logging.INFO):
        calibrated = train_three_steps(tmp_path / "calibrated", calibrate=True)
    assert "DelayedScaling: 2 forward/backward passes on the first batch" in caplog.text
    assert [m["step"] for m in plain] == [1, 2, 3]
    assert [(m["loss"], m["grad_norm"]) for m in calibrated] == [(m["loss"], m["grad_norm"]) for m in plain]
