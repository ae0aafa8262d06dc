"""Per-sequence embeddings and masked-codon pseudo-log-likelihoods of a trained Encodon, with ``Trainer.predict``.

    python predict.py model_path=outputs/L0_sanity/final_model data.predict_path=data/sanity_val.parquet \
        output_dir=outputs/predictions
    python predict.py model_path=outputs/encodon_80m/checkpoints/last.ckpt data.predict_path=genes.fasta ...
    torchrun --nproc_per_node=8 predict.py ...       # each GPU takes a contiguous share of the sequences

``model_path`` is an export of this recipe (``final_model/``) or a Lightning checkpoint (``.ckpt``) of pre-training.
Writes ``<output_dir>/predictions.parquet`` (``index``, ``id``, ``num_codons``, ``pll``, ``mean_log_likelihood``) and
``<output_dir>/embeddings.npy`` (prediction.py says how each is computed; ``num_codons`` and the PLL count real codons
only, never an ``<UNK>``). Every key is in hydra_config/predict.yaml.
"""

import logging
import os
from pathlib import Path

import hydra
import lightning as L
import torch
from datamodule import CodonDataModule
from lightning_module import config_from_checkpoint
from modeling_codonfm_te import NVEncodonConfig, NVEncodonForMaskedLM
from omegaconf import DictConfig, OmegaConf
from perf_logger import quiet_progress_bars_off_a_terminal
from prediction import EncodonPredictModule, PredictionWriter
from recipe_paths import model_directory, recipe_path
from trainer_setup import end_run, process_counts, quiet_lightning
from user_errors import ConfigError, PathNotFoundError, check_config, report_user_errors


logger = logging.getLogger(__name__)


def load_model(model_path: str, backend: str) -> NVEncodonForMaskedLM:
    """The masked-LM model of an export directory or of a Lightning checkpoint of this recipe, in float32."""
    path = recipe_path(model_path)
    if path.is_dir():
        directory = model_directory(model_path, key="model_path", weights=True)
        config = NVEncodonConfig.from_pretrained(directory, backend=backend)
        check_masked_lm(config, model_path)
        return NVEncodonForMaskedLM.from_pretrained(directory, config=config, dtype=torch.float32)
    if not path.is_file():
        raise PathNotFoundError(f"model_path={model_path}: no such export directory or checkpoint file")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # a checkpoint this recipe wrote
    if "model_config" not in checkpoint:
        raise ConfigError(f"model_path={model_path} is not a checkpoint of this recipe (it has no model_config)")
    config = config_from_checkpoint(checkpoint)
    config.backend, config.layer_precision = backend, None  # FP8 is a training setting; predict in bf16/fp32
    check_masked_lm(config, model_path)
    model = NVEncodonForMaskedLM(config)
    weights = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [key for key in missing if not key.endswith("_extra_state")]
    unexpected = [key for key in unexpected if not key.endswith("_extra_state")]
    if missing or unexpected:
        raise ConfigError(
            f"model_path={model_path} does not hold this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model


def check_masked_lm(config: NVEncodonConfig, model_path: str) -> None:
    architectures = config.architectures or ["NVEncodonForMaskedLM"]
    if "NVEncodonForMaskedLM" not in architectures:
        raise ConfigError(
            f"model_path={model_path} holds a {architectures[0]}: pseudo-log-likelihoods need the masked-LM head of a "
            "pre-training run (its final_model/ or checkpoints/last.ckpt)"
        )


@report_user_errors(hydra.main(config_path="hydra_config", config_name="predict", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    quiet_progress_bars_off_a_terminal()
    quiet_lightning()
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))

    module = EncodonPredictModule(load_model(cfg.model_path, cfg.backend), cfg.pll, cfg.pll_token_budget)
    data = CodonDataModule({**OmegaConf.to_container(cfg.data, resolve=True), "task": "mlm"})
    devices, num_nodes = process_counts(cfg.trainer)
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        precision=cfg.trainer.precision,
        callbacks=[PredictionWriter(Path(cfg.output_dir))],
        logger=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,  # the datamodule gives each rank a contiguous share
    )
    trainer.predict(module, datamodule=data, return_predictions=False)
    end_run()  # multi-process CPU runs leave before the interpreter's teardown (trainer_setup.end_run)


if __name__ == "__main__":
    main()
