"""Cell embeddings of a trained Geneformer, for your own cells.

    python embed.py model_path=outputs/L0_sanity/final_model dataset.path=cells.parquet output_dir=outputs/embeddings
    python embed.py ... hidden_layer=-1 dataset.keep_columns=[cell_type]   # the last layer; carry a label along
    torchrun --nproc_per_node=8 embed.py ...                                # each GPU takes a contiguous share

``model_path`` is an export of this recipe (``<output_dir>/final_model``) or a published Geneformer checkpoint (a
stock ``BertForMaskedLM``, converted on load). The cells are read and checked as in training (dataset.py: Parquet
files of gene token ids, the same validation, truncation to ``dataset.max_seq_length`` and empty-cell policy).

A cell's embedding is the mean, over its genes, of the hidden states ``hidden_layer`` names (Hugging Face's
``hidden_states`` numbering: 0 is the embedding layer's output, -1 the last layer's; the default -2 is the
second-to-last layer's), computed in float32 from the model's output. Cells are packed (THD) into forward passes of
at most ``token_budget`` genes, in input order, so no padding is computed. Writes ``<output_dir>/cells.parquet``
(``index``: the cell's row over all input files in order; ``file`` (its path) and ``row``: where it came from; ``num_genes``:
the genes embedded, after truncation; then the ``dataset.keep_columns``) and ``<output_dir>/embeddings.npy``
(float32 [rows of cells.parquet, hidden]). Empty cells skipped by the policy have no row. Every key is in
hydra_config/embed.yaml.
"""

import logging
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from convert import convert_geneformer_hf_to_te
from dataset import load_cells, parquet_files
from distributed import cleanup_distributed, setup_distributed
from model_setup import is_stock_bert, load_tokenizer
from modeling_geneformer_te import NVGeneformerForMaskedLM, NVGeneformerModel
from omegaconf import DictConfig, OmegaConf
from perf_logger import quiet_progress_bars_off_a_terminal
from prediction_files import contiguous_share, merge_rank_files, packed_passes, write_rank_files
from recipe_paths import model_directory
from tqdm import tqdm
from transformers import BertForMaskedLM
from user_errors import ConfigError, check_config, report_user_errors


logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TABLE = "cells"  # cells.parquet


def load_encoder(model_path: str, backend: str) -> NVGeneformerModel:
    """The Geneformer encoder (``.bert``) of an export or a published checkpoint, in float32, in eval mode."""
    directory = str(model_directory(model_path, key="model_path", weights=True))
    if is_stock_bert(directory, key="model_path"):
        stock = BertForMaskedLM.from_pretrained(directory, dtype=torch.float32)
        model = convert_geneformer_hf_to_te(stock, backend=backend)
    else:
        model = NVGeneformerForMaskedLM.from_pretrained(directory, backend=backend, dtype=torch.float32)
    return model.bert.eval()


class CellEmbedder:
    """Mean hidden state over each cell's genes, from packed forward passes of ``encoder`` (an ``NVGeneformerModel``)."""

    def __init__(self, encoder: NVGeneformerModel, device: torch.device, token_budget: int, hidden_layer: int):
        self.encoder, self.device, self.token_budget = encoder, device, int(token_budget)
        n_layers = len(encoder.encoder.layers)
        # Counted from the end (-1 = the last layer's output), only the last layer's needs no per-layer states.
        self.hidden_layer = hidden_layer if hidden_layer < 0 else hidden_layer - (n_layers + 1)

    @torch.no_grad()
    def embeddings(self, cells: list[np.ndarray], progress: bool = False) -> np.ndarray:
        """[cells, hidden] float32: each cell's mean hidden state over its genes."""
        rows = []
        bar = tqdm(total=len(cells), desc="cell embeddings", unit="cell", disable=not progress)
        for run in packed_passes([len(cell) for cell in cells], self.token_budget):
            lengths = torch.tensor([len(cells[i]) for i in run])
            input_ids = torch.from_numpy(np.concatenate([cells[i] for i in run])).to(self.device)
            cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(device=self.device, dtype=torch.int32)
            packed = self.encoder.pack(input_ids[None], None, cu_seqlens, cu_seqlens, int(lengths.max()))
            last, per_layer = self.encoder.forward_packed(packed, output_hidden_states=self.hidden_layer != -1)
            hidden = last if self.hidden_layer == -1 else per_layer[self.hidden_layer]
            cell_of_gene = torch.repeat_interleave(torch.arange(len(run), device=self.device), lengths.to(self.device))
            sums = torch.zeros(len(run), hidden.shape[-1], dtype=torch.float32, device=self.device)
            sums.index_add_(0, cell_of_gene, hidden[: len(cell_of_gene)].float())  # rows past it: alignment padding
            rows.append((sums / lengths.to(self.device).unsqueeze(1)).cpu())
            bar.update(len(run))
        bar.close()
        return torch.cat(rows).numpy() if rows else np.zeros((0, 0), dtype=np.float32)


def kept_columns(files: list[Path], columns: list[str]) -> pa.Table:
    """``columns`` of every cell file, the files' rows end to end (the order cells are counted in)."""
    tables = []
    for file in files:
        names = pq.read_schema(file).names
        missing = [column for column in columns if column not in names]
        if missing:
            raise ConfigError(
                f"{file}: no column {missing[0]!r} to keep; its columns are {names}: fix dataset.keep_columns"
            )
        tables.append(pq.read_table(file, columns=columns))
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as error:
        raise ConfigError(f"dataset.keep_columns {columns}: the files disagree on their types ({error})") from None


def check_settings(cfg: DictConfig, encoder: NVGeneformerModel) -> int:
    """The ``max_seq_length`` this run truncates to, after checking the keys that depend on the model."""
    positions, n_layers = encoder.config.max_position_embeddings, len(encoder.encoder.layers)
    max_seq_length = positions if cfg.dataset.max_seq_length is None else int(cfg.dataset.max_seq_length)
    if not 0 < max_seq_length <= positions:
        raise ConfigError(
            f"dataset.max_seq_length={max_seq_length}: the model embeds positions 1..{positions}; set it in that "
            "range, or to null for the model's own"
        )
    if int(cfg.token_budget) < max_seq_length:
        raise ConfigError(
            f"token_budget={cfg.token_budget} is below the {max_seq_length} genes a cell may keep "
            "(dataset.max_seq_length): a pass must hold the longest cell"
        )
    if not -(n_layers + 1) <= int(cfg.hidden_layer) <= n_layers:
        raise ConfigError(
            f"hidden_layer={cfg.hidden_layer}: the model has {n_layers} layers, so hidden states 0..{n_layers} "
            f"(or -{n_layers + 1}..-1 from the end)"
        )
    return max_seq_length


@report_user_errors(hydra.main(config_path="hydra_config", config_name="embed", version_base="1.3"))
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    quiet_progress_bars_off_a_terminal()
    if cfg.dtype not in ("auto", *DTYPES):
        raise ConfigError(f"dtype={cfg.dtype}: choose auto, {' or '.join(DTYPES)}")
    dist_config, device = setup_distributed()
    if not dist_config.is_main_process():
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("Config:\n%s", OmegaConf.to_yaml(cfg))
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    encoder = load_encoder(cfg.model_path, cfg.backend)
    max_seq_length = check_settings(cfg, encoder)
    tokenizer = load_tokenizer(
        OmegaConf.create({"tokenizer_path": cfg.tokenizer_path, "model_tag": cfg.model_path}), encoder.config
    )
    # auto: bf16 where the layers are TE's (a GPU; as training computes there), float32 on the torch backend.
    dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else torch.bfloat16 if encoder.backend == "te" else torch.float32
    encoder.to(device=device, dtype=dtype)
    logger.info("Geneformer encoder from %s: %s backend, %s on %s", cfg.model_path, encoder.backend, dtype, device)

    data = cfg.dataset
    if not dist_config.is_main_process():  # load_cells logs its summary: once is enough
        logging.getLogger("dataset").setLevel(logging.ERROR)
    cells = load_cells(data.path, tokenizer, data.input_ids_column, max_seq_length, data.empty_cell_policy)
    files = parquet_files(data.path)  # the files load_cells read, in its order
    keep = list(data.keep_columns)
    extra = kept_columns(files, keep) if keep else None
    used = np.flatnonzero(cells.lengths > 0)  # empty cells skipped by the policy (load_cells raised if "error")
    file_starts = np.concatenate([[0], np.cumsum(np.bincount(cells.file_of_row, minlength=len(files)))])

    # Each rank takes a contiguous share, so the shares joined in rank order are in input order.
    mine = used[contiguous_share(len(used), dist_config.rank, dist_config.world_size)]
    embedder = CellEmbedder(encoder, device, cfg.token_budget, int(cfg.hidden_layer))
    started = time.perf_counter()
    embeddings = embedder.embeddings(
        [cells.cell(row) for row in mine], dist_config.is_main_process() and sys.stderr.isatty()
    )
    elapsed = time.perf_counter() - started
    genes = int(cells.lengths[mine].sum())
    logger.info(
        "Embedded %d cells, %d genes (this rank's share) in %.1f s (%.0f genes/s)",
        len(mine),
        genes,
        elapsed,
        genes / max(elapsed, 1e-9),
    )
    file_index = cells.file_of_row[mine]
    columns = {
        "index": pa.array(mine, pa.int64()),
        "file": pa.array([str(files[i]) for i in file_index], pa.string()),
        "row": pa.array(mine - file_starts[file_index], pa.int64()),
        "num_genes": pa.array(cells.lengths[mine], pa.int32()),
    }
    table = pa.table(columns)
    for name in keep:
        table = table.append_column(name, extra.column(name).take(pa.array(mine, pa.int64())))
    write_rank_files(output_dir, dist_config.rank, table, embeddings, TABLE)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written
    if dist_config.is_main_process():
        table_file, embedding_file = merge_rank_files(output_dir, dist_config.world_size, TABLE)
        logger.info("Wrote %s (%d cells) and %s", table_file, len(used), embedding_file)
    cleanup_distributed()


if __name__ == "__main__":
    main()
