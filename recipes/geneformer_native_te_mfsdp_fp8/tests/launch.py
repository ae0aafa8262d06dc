# Copied from common/tests/launch.py — edit the source, then run ci/check_copies.py --fix
"""Run a script the way a user does: ``torchrun`` in a subprocess, or plain ``python`` for one process."""

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


RECIPE_DIR = Path(__file__).resolve().parent.parent


def script_command(script: str | Path, *args: str, nproc: int | None = None) -> list[str]:
    """``python script args`` or, with ``nproc``, the same under ``torchrun --standalone``."""
    command = [sys.executable]
    if nproc is not None:
        # --standalone picks a free rendezvous port, so parallel test runs cannot collide.
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*command, str(script), *args]


def script_env(env: dict | None = None, cpu_only: bool = True) -> dict:
    """The environment a launched script gets: this one without torchrun's variables, plus the recipe on the path."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run_env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(RECIPE_DIR), run_env.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",  # two ranks on two cores: more threads only oversubscribe
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
            # A run killed at its timeout (below) prints every Python thread's stack: where it hung.
            "PYTHONFAULTHANDLER": "1",
        }
    )
    if cpu_only:
        run_env["CUDA_VISIBLE_DEVICES"] = ""
    run_env.update(env or {})
    return run_env


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
    command = script_command(script, *args, nproc=nproc)
    process = subprocess.Popen(
        command,
        cwd=RECIPE_DIR,
        env=script_env(env, cpu_only),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = abort_process_tree(process)
        raise AssertionError(
            f"{' '.join(command)} did not finish in {timeout} s; the stacks of its Python processes when they were "
            f"stopped are at the end of stderr\n--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-20000:]}"
        ) from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if (result.returncode != 0) != expect_failure:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-10000:]}"
        )
    return result


def abort_process_tree(process: subprocess.Popen, grace_s: float = 5.0) -> tuple[str, str]:
    """Stop a launched run that hangs, with every process under it (torchrun's ranks, data-loader workers), and
    return its output. (``subprocess.run``'s timeout kills only the launcher, and torchrun's ranks, each in a session
    of its own, would go on running.)

    The whole tree is frozen first, so that no launcher sees a rank die and tears the others down before they report.
    Then each process in turn, children before parents, gets SIGABRT and is let go: with ``PYTHONFAULTHANDLER=1`` it
    writes the stack of every thread to stderr and exits. One at a time, because the processes share one stderr pipe
    and their reports would otherwise interleave mid-line. A process still there after ``grace_s`` is SIGKILLed."""
    # Read the pipes while the processes report, so that no report blocks on a full pipe.
    output: list[tuple[str, str]] = []
    reader = threading.Thread(target=lambda: output.append(process.communicate()), daemon=True)
    reader.start()
    frozen = _freeze_tree(process.pid)
    for pid in reversed(frozen):  # found parents first: the reverse reports the ranks before their launcher
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=30)
    if not output:  # a process outside the tree still holds the pipes
        return "", "(no output: a process started by the run still holds its pipes)"
    return output[0]


def assert_logs_read_well_off_a_terminal(result: subprocess.CompletedProcess) -> None:
    """A run whose output is a pipe (as in a log file or a SLURM job) prints plain lines: no carriage-return progress
    bar, a ``step N/M | loss ...`` line per logging step, and no warning that no user can act on."""
    output = result.stdout + result.stderr
    assert "\r" not in output, "a progress bar wrote carriage returns:\n" + output[-2000:]
    assert "| loss " in output and "tokens/s/gpu" in output, "no progress lines:\n" + output[-2000:]
    assert "set_vital" not in output, output[-2000:]


def assert_user_error(result: subprocess.CompletedProcess, *phrases: str) -> str:
    """Exit status 2, no traceback anywhere, and stderr ending in one ``error: ...`` line holding every phrase (a
    script outside Hydra prefixes its name: ``evaluate_fasta_lm_loss: error: ...``)."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") or ": error: " in last, result.stderr[-3000:]
    for phrase in phrases:
        assert phrase in last, (phrase, last)
    return last


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with a hash of its bytes: what a failed run must leave as it was."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def start_script(
    script: str | Path,
    *args: str,
    log_file: Path,
    nproc: int | None = None,
    env: dict | None = None,
    cpu_only: bool = True,
) -> subprocess.Popen:
    """Start ``script`` as :func:`run_script` would, without waiting; stdout and stderr go to ``log_file``.

    In a session of its own, so that signals meant for the test (Ctrl-C) do not reach it; end it with
    :func:`kill_process_tree`.
    """
    with open(log_file, "w") as log:  # the child holds its own descriptor
        return subprocess.Popen(
            script_command(script, *args, nproc=nproc),
            cwd=RECIPE_DIR,
            env=script_env(env, cpu_only),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents before their children, from ``/proc/<pid>/task/<tid>/children``."""
    tree, pending = [], [pid]
    while pending:
        process = pending.pop(0)
        tree.append(process)
        for children in Path(f"/proc/{process}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the process or thread has just exited
                pending += [int(child) for child in children.read_text().split() if int(child) not in tree]
    return tree


def _freeze_tree(pid: int) -> list[int]:
    """SIGSTOP ``pid`` and all its descendants; return them, parents first (Linux: reads ``/proc``).

    ``os.killpg`` is not enough: torchrun starts each rank in a session of its own. A stopped process cannot start
    another, nor notice that its parent or child died; the tree is read again until a pass finds no new process.
    """
    stopped: list[int] = []
    while new := [process for process in _tree(pid) if process not in stopped]:
        for process in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process, signal.SIGSTOP)
        stopped += new
        time.sleep(0.01)  # a fork that the stop interrupted completes first: look again for its child
    return stopped


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at one instant, as a node failure would: the whole tree is frozen
    first, then every process in it is killed."""
    stopped = _freeze_tree(pid)
    for process in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)
    while any(_alive(process) for process in stopped):  # gone, or a zombie that nobody has reaped yet
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # the state follows the parenthesised name
