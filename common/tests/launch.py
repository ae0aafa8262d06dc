"""Run a script the way a user does: ``torchrun`` in a subprocess, or plain ``python`` for one process."""

import os
import subprocess
import sys
from pathlib import Path


RECIPE_DIR = Path(__file__).resolve().parent.parent


def run_script(
    script: str | Path,
    *args: str,
    nproc: int | None = None,
    timeout: int = 300,
    env: dict | None = None,
    expect_failure: bool = False,
    cpu_only: bool = True,
):
    """Run ``script`` from the recipe folder; ``nproc=None`` means plain ``python`` with no torchrun variables.

    Raises with the process's output when it fails (or, with ``expect_failure``, when it succeeds), so a failing
    test shows why. ``cpu_only`` hides GPUs, so CPU tests mean the same thing on a GPU machine.
    """
    command = [sys.executable]
    if nproc is not None:
        # --standalone picks a free rendezvous port, so parallel test runs cannot collide.
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [str(script), *args]
    run_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run_env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(RECIPE_DIR), run_env.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",  # two ranks on two cores: more threads only oversubscribe
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
        }
    )
    if cpu_only:
        run_env["CUDA_VISIBLE_DEVICES"] = ""
    run_env.update(env or {})
    result = subprocess.run(
        command, cwd=RECIPE_DIR, env=run_env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if (result.returncode != 0) != expect_failure:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-10000:]}"
        )
    return result
