# Copied from common/wandb_run.py — edit the source, then run ci/check_copies.py --fix
"""Weights & Biases for the training scripts (rank 0 only).

``wandb.mode``: ``disabled`` (the default; wandb is never imported), ``offline`` (the run is written under
``<output_dir>/wandb``; upload it later with ``wandb sync``) or ``online``.

One training run is one W&B run, also across restarts. The W&B run's id is kept in ``<output_dir>/wandb_run_id``, and
a job that resumes from a checkpoint continues that W&B run (``resume="allow"``) instead of starting another, so a
preempted and requeued job shows one curve. A job that starts from step 0 starts a new W&B run and records its id.
"""

import logging
from pathlib import Path

from omegaconf import OmegaConf
from user_errors import ConfigError, MissingPackageError


logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"


def start_wandb_run(cfg, resuming: bool):
    """The W&B run this job logs to, or None with ``wandb.mode=disabled``. ``resuming``: the job continues from a
    checkpoint (then the run whose id ``<output_dir>/wandb_run_id`` holds is continued, if there is one)."""
    mode = cfg.wandb.mode
    if mode == "disabled":
        return None
    if mode not in ("online", "offline"):
        raise ConfigError(f"wandb.mode={mode}: choose online, offline or disabled")
    try:
        import wandb
    except ImportError as error:
        raise MissingPackageError(
            f"wandb.mode={mode} needs the wandb package; install it or set wandb.mode=disabled"
        ) from error

    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    id_file = output_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    run = wandb.init(
        mode=mode,
        project=cfg.wandb.project,
        name=cfg.wandb.name,
        dir=str(output_dir),
        config=OmegaConf.to_container(cfg, resolve=True),
        id=run_id,
        resume="allow" if run_id else None,
    )
    id_file.write_text(f"{run.id}\n")
    if run_id:
        logger.info("Continuing W&B run %s, which the job this one resumes logged to", run.id)
    return run
