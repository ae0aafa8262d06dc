"""Per-sequence embeddings and pseudo-log-likelihoods of a trained ESM-2 or AMPLIFY model, for your own sequences.

    python predict.py model_path=outputs/L0_sanity/final_model data.path=proteins.fasta output_dir=outputs/predictions
    python predict.py ... pll=false                    # embeddings only (a PLL costs one forward pass per residue)
    torchrun --nproc_per_node=8 predict.py ...         # each GPU takes a contiguous share of the sequences

``model_path`` is an export of this recipe (``<output_dir>/final_model``, ESM-2 or AMPLIFY), a stock Hugging Face
ESM-2 checkpoint or a published AMPLIFY one. The sequences are read and checked as in training (``dataset.py``: the
same formats, residue alphabet and policies, with ``data.*`` keys). Writes ``<output_dir>/predictions.parquet``
(``index``: the input row, ``id``, ``num_residues``, and with ``pll=true`` ``pll`` and ``mean_log_likelihood``) and
``<output_dir>/embeddings.npy`` (float32 [rows of predictions.parquet, hidden]); prediction.py says how each is
computed. Every key is in hydra_config/predict.yaml.
"""

import logging
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from dataset import KEPT, DataStats, SequencePolicy, load_sequences
from distributed import cleanup_distributed, setup_distributed
from model_families import family_of, load_tokenizer
from omegaconf import DictConfig, OmegaConf
from perf_logger import quiet_progress_bars_off_a_terminal
from prediction import Predictor
from prediction_files import contiguous_share, merge_rank_files, write_rank_files
from recipe_paths import TOKENIZER_FILES, model_directory
from user_errors import ConfigError, check_config, report_user_errors


logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(model_path: str, backend: str, need_lm_head: bool):
    """(family, masked-LM model in float32, tokenizer) of ``model_path``, checked to fit each other."""
    directory = str(model_directory(model_path, key="model_path", weights=True))
    family = family_of(directory)
    config = family.load_config(directory)
    architectures = getattr(config, "architectures", None) or [family.model_class.__name__]
    if need_lm_head and not any(name.endswith("ForMaskedLM") for name in architectures):
        raise ConfigError(
            f"model_path={model_path} holds a {architectures[0]}, which has no masked-LM head: pseudo-log-likelihoods "
            "need a pre-training export (final_model/ of a masked-LM run); set pll=false for embeddings only"
        )
    if family.stock:
        if backend == "te":
            raise ConfigError(
                f"model_path={model_path} is a stock {family.name} checkpoint: it runs with backend=torch"
            )
        model = family.load_weights(directory)  # converted to this recipe's model, torch backend
    else:
        model = family.model_class.from_pretrained(directory, backend=backend, dtype=torch.float32)
    # The export's own tokenizer when it has one (exports do), else this recipe's tokenizer for the family; either
    # way load_tokenizer checks that its vocabulary is the model's.
    has_tokenizer = any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)
    tokenizer_cfg = {"model_tag": directory, "init_from_pretrained": True}
    tokenizer = load_tokenizer(
        OmegaConf.create({**tokenizer_cfg, "tokenizer_path": directory if has_tokenizer else "auto"})
    )
    return family, model.eval(), tokenizer


def read_sequences(data: DictConfig, tokenizer, log_stats: bool) -> tuple[list[int], list[str], list[str]]:
    """(input rows, ids, cleaned texts) of the sequences the policies keep, in input order."""
    source = load_sequences(
        data.path, data.format, data.sequence_column, data.split, key="data.path", column_key="data.sequence_column"
    )
    if data.id_column == "auto":
        id_column = "id" if "id" in source.column_names else None
    elif data.id_column not in source.column_names:
        raise ConfigError(
            f"{data.path}: no column {data.id_column!r}; columns are {source.column_names}: set data.id_column to one "
            "of them, or to auto"
        )
    else:
        id_column = data.id_column
    policy = SequencePolicy.from_tokenizer(
        tokenizer,
        max_seq_length=int(data.max_seq_length),
        invalid_residue_policy=data.invalid_residue_policy,
        long_sequence_policy=data.long_sequence_policy,
    )
    ids = [str(value) for value in source[id_column]] if id_column else None
    rows, kept_ids, texts, stats = [], [], [], DataStats()
    for row, raw in enumerate(source[data.sequence_column]):
        text, code, n_replaced, truncated = policy.clean(raw, (0, row), f"{data.path} row {row}")
        stats.add(code, n_replaced, truncated)
        if code == KEPT:
            rows.append(row)
            kept_ids.append(ids[row] if ids else str(row))
            texts.append(text)
    if log_stats:
        stats.log(str(data.path))
    return rows, kept_ids, texts


@report_user_errors(hydra.main(config_path="hydra_config", config_name="predict", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    quiet_progress_bars_off_a_terminal()
    if cfg.dtype not in ("auto", *DTYPES):
        raise ConfigError(f"dtype={cfg.dtype}: choose auto, {' or '.join(DTYPES)}")
    for key in ("token_budget", "pll_token_budget"):
        if int(cfg[key]) < int(cfg.data.max_seq_length):
            raise ConfigError(
                f"{key}={cfg[key]} is below data.max_seq_length={cfg.data.max_seq_length}: a pass must hold the "
                "longest sequence"
            )
    dist_config, device = setup_distributed()
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    family, model, tokenizer = load_model(cfg.model_path, cfg.backend, need_lm_head=bool(cfg.pll))
    # auto: bf16 where the layers are TE's (a GPU; as training computes there), float32 on the torch backend.
    dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else torch.bfloat16 if model.backend == "te" else torch.float32
    model.to(device=device, dtype=dtype)
    logger.info("Model: %s from %s, %s backend, %s on %s", family.name, cfg.model_path, model.backend, dtype, device)
    rows, ids, texts = read_sequences(cfg.data, tokenizer, log_stats=dist_config.is_main_process())

    # Each rank takes a contiguous share, so the shares joined in rank order are in input order.
    share = contiguous_share(len(rows), dist_config.rank, dist_config.world_size)
    mine = tokenizer([texts[i] for i in share], add_special_tokens=True)["input_ids"] if len(share) else []
    predictor = Predictor(
        model, family.encoder(model), tokenizer.mask_token_id, device, cfg.token_budget, cfg.pll_token_budget
    )
    progress = dist_config.is_main_process() and sys.stderr.isatty()
    started = time.perf_counter()
    embeddings = predictor.embeddings(mine, progress)
    logger.info("Embedded %d sequences (this rank's share) in %.1f s", len(mine), time.perf_counter() - started)
    columns = {
        "index": pa.array([rows[i] for i in share], pa.int64()),
        "id": pa.array([ids[i] for i in share], pa.string()),
        "num_residues": pa.array([len(tokens) - 2 for tokens in mine], pa.int32()),
    }
    if cfg.pll:
        started = time.perf_counter()
        pll = predictor.pseudo_log_likelihoods(mine, progress)
        columns["pll"] = pa.array(pll, pa.float64())
        columns["mean_log_likelihood"] = pa.array(pll / np.maximum(columns["num_residues"].to_numpy(), 1))
        residues = int(columns["num_residues"].to_numpy().sum())
        logger.info(
            "Scored %d residues (this rank's share, one masked pass each) in %.1f s",
            residues,
            time.perf_counter() - started,
        )
    write_rank_files(output_dir, dist_config.rank, pa.table(columns), embeddings, "predictions")
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written
    if dist_config.is_main_process():
        predictions, embedding_file = merge_rank_files(output_dir, dist_config.world_size, "predictions")
        logger.info("Wrote %s (%d rows) and %s", predictions, len(rows), embedding_file)
    cleanup_distributed()


if __name__ == "__main__":
    main()
