# Copied from common/tests/launch.py — edit the source, then run ci/check_copies.py --fix
"""Run a script the way a user does: ``torchrun`` in a subprocess, or plain ``python`` for one process; or, for a run
that ends before training (a user error), as ``__main__`` inside the test process."""

import contextlib
import functools
import hashlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
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


def run_in_process(
    script: str | Path, *args: str, env: dict | None = None, expect_failure: bool = False
) -> subprocess.CompletedProcess:
    """``python script args`` without a new interpreter: ``script`` runs as ``__main__`` in this process.

    For runs that end before they train, such as a user error, where a subprocess spends ~10 s importing torch and
    transformers for a second of work. The result reads like :func:`run_script`'s: the exit status (``SystemExit``'s
    code; 1 and the traceback on stderr for an uncaught exception, as Python does) and what the script printed
    through ``sys.stdout``/``sys.stderr``. What the script changes in this process is undone afterwards: environment,
    ``sys.argv``, working directory, the root logger's handlers, a process group; and ``os._exit`` (which a finished
    CPU run calls, see ``distributed.cleanup_distributed``) raises ``SystemExit`` instead of ending the test process.
    GPUs are hidden only if ``env`` sets ``CUDA_VISIBLE_DEVICES`` before anything in this process set CUDA up (it
    is read once per process), so a check that depends on the hardware is surest with :func:`run_script`.
    """
    script = RECIPE_DIR / script
    command = [sys.executable, str(script), *args]
    saved_environ, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    root_logger = logging.getLogger()
    saved_handlers, saved_level = root_logger.handlers[:], root_logger.level
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ.update({"TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **(env or {})})
    sys.argv = [str(script), *args]
    os.chdir(RECIPE_DIR)
    process_exit = os._exit
    os._exit = functools.partial(_exit_this_run, process_exit, os.getpid())
    returncode = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exit_:
                returncode = _exit_status(exit_.code)
            except Exception:
                traceback.print_exc()
                returncode = 1
    finally:
        os._exit = process_exit
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        root_logger.handlers[:] = saved_handlers
        root_logger.setLevel(saved_level)
        distributed = sys.modules.get("torch.distributed")
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            distributed.destroy_process_group()  # a run that failed after setting up its (one-rank) group
    result = subprocess.CompletedProcess(command, returncode, stdout.getvalue(), stderr.getvalue())
    if (returncode != 0) != expect_failure:
        raise AssertionError(
            f"{' '.join(command)} (in process) exited with {returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-10000:]}"
        )
    return result


def _exit_this_run(process_exit, test_process: int, status: int) -> None:
    """``os._exit`` during :func:`run_in_process`: the run ends, not the test process. A process forked meanwhile (a
    data-loader worker, which leaves through ``os._exit``) still exits: it would otherwise go on running the tests."""
    if os.getpid() != test_process:
        process_exit(status)
    raise SystemExit(status)


def _exit_status(code) -> int:
    """The exit status Python gives ``sys.exit(code)``: None is 0, a number is itself, anything else is printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


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
