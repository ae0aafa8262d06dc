# Copied from common/checkpoint.py — edit the source, then run ci/check_copies.py --fix
"""Training checkpoints (save, resume, prune) for DDP, FSDP2 and Megatron-FSDP, and the final Hugging Face export.

Layout of ``<ckpt_dir>``::

    step_100/            complete: holds a COMPLETE marker, the only kind ever resumed from
    step_200.tmp/        being written (or left behind by a crash): ignored by resume and by pruning
    step_50.pruning/     an old checkpoint being deleted (or left behind by a crash): removed by the next prune

A checkpoint is written under ``step_<N>.tmp`` and only renamed to ``step_<N>`` with its ``COMPLETE`` marker once
every rank's files are on disk, so a job killed mid-save never resumes from half a checkpoint. For an asynchronous
save that moment is when the background write's future resolves; the pending save is awaited before the next save
starts and when the run ends.

Inside a checkpoint:

- ``rank<r>_state.pt``: per-rank state, saved by every rank because ranks read different data: the
  ``StatefulDataLoader`` position and the RNG streams (masking, dropout and anything else that draws from them).
  A run resumed on another number of ranks restores everything but the RNG streams; a loader whose batch sampler can
  continue other ranks' positions (``EpochBatchSampler.continue_from``, or an iterable dataset with the same three
  methods, as the Llama recipes' ``GenomicBatches`` and ``GenomicStream``) gets all saved ranks' positions and goes on
  with the data of the epoch that none of them had read, any other loader starts its data afresh;
- DDP: ``train_state.pt`` from rank 0 (model, optimizer, scheduler, step);
- FSDP2 / Megatron-FSDP: a ``torch.distributed.checkpoint`` (DCP) directory of sharded model and optimizer states
  plus scheduler and step, each rank writing its own shards.

A resumed run keeps its config's optimizer settings and peak learning rate (a changed ``adamw_kwargs`` applies from
the resumed step on, with a warning that names what changed: optimizer_settings.py).
"""

import logging
import random
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hf_export import write_hf_directory
from optimizer_settings import configured_settings, restore_configured_settings
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from user_errors import ConfigError


logger = logging.getLogger(__name__)

Strategy = Literal["ddp", "fsdp2", "mfsdp"]
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PRUNING_SUFFIX = ".pruning"


# --------------------------------------------------------------------------------------------------------------------
# Finding and pruning checkpoints
# --------------------------------------------------------------------------------------------------------------------


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory (complete or not), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def complete_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint, oldest first."""
    return [(step, path) for step, path in _step_dirs(Path(ckpt_dir)) if (path / COMPLETE_MARKER).is_file()]


def find_latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, logging every half-written one it passes over."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    for path in sorted(ckpt_dir.glob("step_*.tmp")):
        logger.warning("Skipping unfinished checkpoint %s (its save never completed)", path)
    for _, path in _step_dirs(ckpt_dir):
        if not (path / COMPLETE_MARKER).is_file():
            logger.warning("Skipping checkpoint %s: it has no %s marker", path, COMPLETE_MARKER)
    complete = complete_checkpoints(ckpt_dir)
    return complete[-1][1] if complete else None


def prune_checkpoints(ckpt_dir: str | Path, max_checkpoints: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints so that at most ``max_checkpoints`` remain; return what was deleted.

    Only complete checkpoints are candidates: an in-progress ``.tmp`` directory may belong to a save still running,
    and the newest complete one is always kept (``max_checkpoints`` below 1 is treated as 1).

    A checkpoint is renamed to ``step_<N>.pruning`` before its files are deleted. Deleting them one by one may remove
    the marker first, so a job killed midway would otherwise leave a ``step_<N>`` without one, which no later prune
    would touch. Leftover ``.pruning`` directories are deleted here.
    """
    if max_checkpoints is None:
        return []
    for leftover in Path(ckpt_dir).glob(f"step_*{_PRUNING_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete = complete_checkpoints(ckpt_dir)
    doomed = [path for _, path in complete[: max(0, len(complete) - max(1, max_checkpoints))]]
    for path in doomed:
        logger.info("Pruning old checkpoint %s", path)
        shutil.rmtree(path.rename(path.with_name(path.name + _PRUNING_SUFFIX)), ignore_errors=True)
    return doomed


# --------------------------------------------------------------------------------------------------------------------
# Staging a background write
# --------------------------------------------------------------------------------------------------------------------


def _cpu_copy(value: Any) -> Any:
    """A CPU copy of a checkpoint state, for a background write while training goes on. A DTensor becomes a DTensor
    over a CPU copy of its local shard with the same sharding spec; the local shard's attributes come along, among
    them Megatron-FSDP's ``__create_chunk_list__``/``__create_write_items__``, which tell DCP the size of an uneven
    shard."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        local_copy = local.detach().to("cpu", copy=True)
        local_copy.__dict__.update(local.__dict__)
        return DTensor(local_copy, value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(item) for item in value)
    return value


# --------------------------------------------------------------------------------------------------------------------
# Per-rank state: data position and random streams
# --------------------------------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model under DDP's or torch.compile's wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


# --------------------------------------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores everything a run needs to continue bit-for-bit where it stopped.

    Args:
        ckpt_dir: where ``step_<N>`` directories live.
        strategy: ``"ddp"`` (one ``torch.save`` on rank 0), ``"fsdp2"`` (DCP with torch's state-dict helpers), or
            ``"mfsdp"`` (DCP over Megatron-FSDP's own DTensor state dicts).
        async_save: write DCP checkpoints in a background thread while training continues (FSDP2 / Megatron-FSDP).
        max_checkpoints: keep at most this many complete checkpoints (None keeps all).
    """

    def __init__(
        self,
        ckpt_dir: str | Path,
        strategy: Strategy,
        async_save: bool = False,
        max_checkpoints: int | None = None,
    ):
        if strategy not in ("ddp", "fsdp2", "mfsdp"):
            raise ValueError(f"Unknown checkpoint strategy {strategy!r}; expected ddp, fsdp2 or mfsdp")
        if async_save and strategy == "ddp":
            raise ValueError("async_save needs a DCP strategy (fsdp2 or mfsdp); DDP checkpoints are saved by rank 0")
        self.ckpt_dir = Path(ckpt_dir)
        self.strategy = strategy
        self.async_save = async_save
        self.max_checkpoints = max_checkpoints
        self._pending: tuple[Future, int] | None = None
        # The background writer runs collectives while training runs its own: on a separate gloo group they cannot
        # interleave with the gradient all-reduces (and gloo moves the CPU-staged copy without touching the GPU).
        self._async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        # Megatron-FSDP's background writes: the thread that runs DCP's save over a copy staged by _cpu_copy.
        self._writer: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- save

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Any = None,
    ) -> None:
        """Write checkpoint ``step``; collective, so every rank calls it."""
        self.wait()  # one save in flight at a time: the previous one must be finalised before a new one starts
        final_dir, tmp_dir = self.ckpt_dir / f"step_{step}", self.ckpt_dir / f"step_{step}.tmp"
        # Rank 0 decides for everyone: it finalises saves, so another rank could look before its rename lands.
        if _broadcast_from_rank0((final_dir / COMPLETE_MARKER).is_file() if _rank() == 0 else None):
            logger.info("Checkpoint %s already exists; not saving it again", final_dir)
            return
        if _rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # debris from a crashed earlier attempt at this step
            tmp_dir.mkdir(parents=True)
        _barrier()

        # Written first and synchronously: the DCP save below finishes on rank 0 only after every rank has gone
        # through here, so its completion also vouches for these files.
        rank_state = {
            "world_size": _world_size(),
            "dataloader": dataloader.state_dict() if dataloader is not None else None,
            "rng": _rng_state(),
        }
        torch.save(rank_state, tmp_dir / f"rank{_rank()}_state.pt")

        if self.strategy == "ddp":
            if _rank() == 0:
                train_state = {
                    "model": _unwrap(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                }
                torch.save(train_state, tmp_dir / "train_state.pt")
            _barrier()
            self._finalize(step)
            return

        state = self._dcp_state(model, optimizer, scheduler, step)
        if self.async_save and self.strategy == "mfsdp":
            # DCP's async_save stages by copying each tensor's whole storage, which fails on Megatron-FSDP's
            # parameter DTensors (torch 2.11, megatron-fsdp 0.6.1: "Attempted to call copy_() on an invalid python
            # storage"). So the CPU copy is made here, before training changes the weights again, and a background
            # thread writes it with DCP's synchronous save, as async_save's own thread would.
            cpu_state = _cpu_copy(state)
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
            write = self._writer.submit(
                dcp.save, cpu_state, checkpoint_id=str(tmp_dir), process_group=self._async_group
            )
            self._pending = (write, step)
        elif self.async_save:
            response = dcp.async_save(state, checkpoint_id=str(tmp_dir), process_group=self._async_group)
            # Newer torch may return a response holding separate staging and upload futures.
            self._pending = (getattr(response, "upload_completion", response), step)
        else:
            dcp.save(state, checkpoint_id=str(tmp_dir))
            _barrier()
            self._finalize(step)

    def poll(self) -> None:
        """Finalise a background save if it has finished; cheap enough to call every step."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight asynchronous save (if any) is written, then mark it complete."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        future.result()  # re-raises a failed background write here instead of losing it
        self._finalize(step)

    def close(self) -> None:
        """Await the last save; call before the process exits or the background write dies with it."""
        self.wait()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None

    def _finalize(self, step: int) -> None:
        """On rank 0: mark ``step_<N>.tmp`` complete, give it its final name, and prune old checkpoints."""
        if _rank() != 0:
            return
        tmp_dir, final_dir = self.ckpt_dir / f"step_{step}.tmp", self.ckpt_dir / f"step_{step}"
        (tmp_dir / COMPLETE_MARKER).write_text(f"step {step}\n")
        tmp_dir.rename(final_dir)
        logger.info("Saved checkpoint %s", final_dir)
        prune_checkpoints(self.ckpt_dir, self.max_checkpoints)

    def _dcp_state(self, model, optimizer, scheduler, step: int) -> dict[str, Any]:
        """The dictionary DCP saves from and loads into (loading fills its tensors in place)."""
        if self.strategy == "fsdp2":
            # get_state_dict also creates the optimizer's state when it is still empty, which a load needs.
            model_state, optim_state = get_state_dict(model, optimizer)
        else:
            # Megatron-FSDP's wrappers expose DTensor state dicts that DCP understands directly, and its
            # fully_shard_optimizer has already created the optimizer state.
            model_state, optim_state = model.state_dict(), optimizer.state_dict()
        return {"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict(), "step": step}

    # ---------------------------------------------------------------- load

    def start_afresh(self) -> int:
        """Begin at step 0 without resuming (``checkpoint.resume=false``); returns 0.

        Refuses (``ConfigError``, on every rank) a checkpoint directory that holds complete checkpoints: they are an
        earlier run's, and this run's saves would meet them. A step they already hold would not be saved again,
        pruning would delete this run's checkpoints as the oldest, and a later resume would continue the earlier run.
        Unfinished ``.tmp`` leftovers are no obstacle (resume never reads them and a save replaces them).
        """
        # Rank 0 looks, so that every rank stops or none does.
        newest = _broadcast_from_rank0(find_latest_checkpoint(self.ckpt_dir) if _rank() == 0 else None)
        if newest is not None:
            raise ConfigError(
                f"checkpoint.resume=false, but {self.ckpt_dir} holds checkpoints of an earlier run (newest: "
                f"{newest.name}); this run's checkpoints would mix with them. Start afresh in a new output_dir (or "
                "checkpoint.ckpt_dir), delete those checkpoints, or continue them with checkpoint.resume=true"
            )
        return 0

    def load_latest(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Any = None,
        map_location: torch.device | str = "cpu",
    ) -> int:
        """Restore the newest complete checkpoint into the given objects; return its step (0 when there is none).
        The optimizer's settings (lr, betas, eps, weight decay) and the peak learning rate stay the config's
        (optimizer_settings.py); its state and the schedule's step come from the checkpoint."""
        # Rank 0 decides, so that every rank resumes from the same step.
        path = _broadcast_from_rank0(find_latest_checkpoint(self.ckpt_dir) if _rank() == 0 else None)
        if path is None:
            return 0

        _check_strategy(path, self.strategy)
        configured = configured_settings(optimizer, scheduler)  # the config's, which the loads below overwrite
        if self.strategy == "ddp":
            train_state = torch.load(path / "train_state.pt", map_location=map_location, weights_only=True)
            _check_shapes(path, _shapes(train_state["model"]), _shapes(_unwrap(model).state_dict()))
            _unwrap(model).load_state_dict(train_state["model"])
            optimizer.load_state_dict(train_state["optimizer"])
            scheduler.load_state_dict(train_state["scheduler"])
            step = int(train_state["step"])
        else:
            state = self._dcp_state(model, optimizer, scheduler, step=0)
            if self.strategy == "fsdp2":  # (Megatron-FSDP's own state dicts are not compared)
                saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
                _check_shapes(path, _saved_model_shapes(saved), _shapes(state["model"]))
            dcp.load(state, checkpoint_id=str(path))
            if self.strategy == "fsdp2":
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            else:
                model.load_state_dict(state["model"], strict=False)  # TE's _extra_state is not checkpointed
                optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step = int(state["step"])
        restore_configured_settings(optimizer, scheduler, configured, str(path))

        self._load_rank_state(path, dataloader)
        logger.info("Resumed from %s (step %d)", path, step)
        return step

    def _load_rank_state(self, path: Path, dataloader: Any) -> None:
        rank_state = _read_rank_state(path, _rank())
        order = _continuable_data_order(dataloader)
        if rank_state is not None and rank_state["world_size"] == _world_size():
            loader_state = rank_state["dataloader"]
            order_state = order.position_in(loader_state) if order is not None else None
            # (The same number of ranks may still read the data otherwise: another split into data-parallel ranks,
            # e.g. another cp_size, or, for Llama's windows, another batch shape.)
            if order is None or order_state is None or order.reads_like(order_state):
                if dataloader is not None and loader_state is not None:
                    _load_loader_state(dataloader, loader_state, order, order_state)
                _set_rng_state(rank_state["rng"])
                return
        saved_world = rank_state["world_size"] if rank_state else _saved_world_size(path)
        data = "the data order starts afresh"
        if order is not None and saved_world:
            try:
                data = order.continue_from(_saved_order_states(path, saved_world, order))
            except (ValueError, FileNotFoundError) as err:
                data = f"the data order starts afresh ({err})"
        if saved_world == _world_size():
            ranks = (
                f"was written by {saved_world} ranks that read the data otherwise (another cp_size, batch shape or "
                "dataset)"
            )
        else:
            ranks = f"was written by {saved_world or 'an unknown number of'} ranks, this run has {_world_size()}"
        logger.warning(
            "Checkpoint %s %s: model, optimizer, schedule and step are restored; %s; RNG streams start afresh",
            path,
            ranks,
            data,
        )


def _loader_workers(loader_state: dict) -> int:
    """How many worker processes the ``StatefulDataLoader`` that saved ``loader_state`` ran."""
    snapshot = loader_state.get("_snapshot")
    return len(snapshot["_worker_snapshots"]) if snapshot else 0


def _load_loader_state(dataloader: Any, loader_state: dict, order: Any, order_state: dict | None) -> None:
    """Restore the loader's position. A loader state only loads into a loader with as many worker processes
    (torchdata asserts otherwise); with another ``dataset.num_workers`` the position is what orders the data (its
    batch sampler or iterable dataset), so that is restored instead, and the loader starts its workers afresh."""
    saved_workers = _loader_workers(loader_state)
    if saved_workers == dataloader.num_workers:
        dataloader.load_state_dict(loader_state)
        return
    if order is None or order_state is None:
        raise ConfigError(
            f"the checkpoint's data loader ran {saved_workers} worker process(es) and this run's runs "
            f"{dataloader.num_workers}: resume with dataset.num_workers={saved_workers}"
        )
    order.load_state_dict(order_state)
    logger.info(
        "dataset.num_workers is %d, the checkpoint's was %d: the data position is restored from its data order",
        dataloader.num_workers,
        saved_workers,
    )


def _read_rank_state(path: Path, rank: int) -> dict | None:
    rank_file = path / f"rank{rank}_state.pt"
    # numpy's RNG state is not loadable with weights_only=True; the file is one this recipe wrote itself.
    return torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else None


def _saved_world_size(path: Path) -> int | None:
    """The number of ranks that wrote ``path``, read from rank 0's file (None if it has none)."""
    state = _read_rank_state(path, 0)
    return state["world_size"] if state else None


def _continuable_data_order(dataloader: Any) -> Any:
    """What orders the loader's data, if it can continue another world's positions, else None: its batch sampler
    (``EpochBatchSampler``) or its iterable dataset (the Llama recipes' ``GenomicBatches``, ``GenomicStream``)."""
    needed = ("continue_from", "reads_like", "position_in")
    for source in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if all(hasattr(source, name) for name in needed):
            return source
    return None


def _saved_order_states(path: Path, saved_world: int, order: Any) -> list[dict]:
    """Every saved rank's data-order state (each rank of the new world reads them all: they are small)."""
    states = []
    for rank in range(saved_world):
        state = _read_rank_state(path, rank)
        if state is None:
            raise FileNotFoundError(f"{path} lacks rank{rank}_state.pt")
        order_state = order.position_in(state["dataloader"])
        if order_state is None:
            raise ValueError(f"rank {rank} saved no data position")
        states.append(order_state)
    return states


def _check_strategy(path: Path, strategy: Strategy) -> None:
    """A DDP checkpoint (one ``train_state.pt``) and a DCP one (FSDP2, Megatron-FSDP) do not load into each other."""
    written_by_ddp = (path / "train_state.pt").is_file()
    if written_by_ddp != (strategy == "ddp"):
        saved, this = ("DDP", strategy.upper()) if written_by_ddp else ("FSDP2 or Megatron-FSDP", "DDP")
        raise ConfigError(
            f"checkpoint {path} was written by a {saved} run and this is a {this} run: resume it with the entrypoint "
            "that wrote it, or start afresh with a new output_dir"
        )


def _shapes(state_dict: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes by key (a DTensor's global shape), without TE's FP8 bookkeeping (``_extra_state``)."""
    return {
        k: tuple(v.shape)
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def _saved_model_shapes(metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The model tensors' shapes in a DCP checkpoint's metadata (its model keys start with ``model.``)."""
    return {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.items()
        if k.startswith("model.") and hasattr(v, "size") and not k.endswith("_extra_state")
    }


def _check_shapes(path: Path, saved: dict[str, tuple], current: dict[str, tuple]) -> None:
    """Refuse to resume a checkpoint of another model shape (a changed model_tag or model_config_overrides)."""
    differ = [k for k in current if k in saved and saved[k] != current[k]]
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if differ:
        detail = f"{differ[0]} is {list(saved[differ[0]])} there and {list(current[differ[0]])} here"
    elif missing:
        detail = f"it lacks {missing[0]}" + (f" and {len(missing) - 1} more weights" if len(missing) > 1 else "")
    elif extra:
        detail = f"it has {extra[0]}, which this model lacks" + (
            f", and {len(extra) - 1} more" if len(extra) > 1 else ""
        )
    else:
        return
    raise ConfigError(
        f"checkpoint {path} holds a model of another shape ({detail}): resume with the model settings that wrote it "
        "(model_tag, model_config_overrides), or start afresh with a new output_dir"
    )


# --------------------------------------------------------------------------------------------------------------------
# Final export
# --------------------------------------------------------------------------------------------------------------------


def gather_full_state_dict(model: torch.nn.Module, strategy: Strategy) -> dict[str, torch.Tensor]:
    """The unsharded model weights on CPU; collective for the FSDP strategies, filled on rank 0 only."""
    if strategy == "ddp":
        return {k: v.detach().cpu() for k, v in _unwrap(model).state_dict().items()}
    if strategy == "fsdp2":
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Megatron-FSDP: its parameters are DTensors holding uneven row ranges of its flat buffers. DTensor.full_tensor()
    # assumes torch's even chunks (on 2 ranks its all-gather sizes disagree); Megatron-FSDP's own gather does not.
    # A collective on all ranks.
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    full = {}
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        value = uneven_dtensor_to_full_tensor(value) if isinstance(value, DTensor) else value
        full[key.removeprefix("module.")] = value.detach().cpu()
    return full


def export_final_model(
    model: torch.nn.Module,
    full_state_dict: dict[str, torch.Tensor],
    output_dir: str | Path,
    tokenizer: Any = None,
) -> Path | None:
    """Write the trained model as a Hugging Face directory on rank 0 (``hf_export.write_hf_directory``).

    ``AutoModel*.from_pretrained(output_dir, trust_remote_code=True)`` loads the result, on any machine: the saved
    config has no FP8/FP4 layers and ``backend: auto``. The directory appears only once complete, and an earlier
    export there is replaced only after the new one is whole.

    Args:
        model: the trained model, possibly wrapped or sharded: only its config, class and ``save_pretrained`` are
            used, the weights come from ``full_state_dict``, so no second full-size copy of the model is built.
        full_state_dict: unsharded weights from :func:`gather_full_state_dict`.
    """
    if _rank() != 0:
        return None
    return write_hf_directory(_unwrap(model), output_dir, state_dict=full_state_dict, tokenizer=tokenizer)
