"""common/tests/launch.py (copied into every recipe's tests): a launched run that hangs is stopped with every process
under it, and the failure shows where each Python process was."""

import importlib.util
import textwrap
import time
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("launch", REPO_ROOT / "common" / "tests" / "launch.py")
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")

# A launcher that starts a worker in a session of its own (as torchrun starts its ranks) and then both wait for ever.
HANGING_LAUNCHER = """
    import subprocess, sys, time
    from pathlib import Path

    WORKER = "import time\\ndef worker_waits_for_ever():\\n    while True:\\n        time.sleep(1)\\nworker_waits_for_ever()\\n"

    def launcher_waits_for_ever():
        while True:
            time.sleep(1)

    worker = subprocess.Popen([sys.executable, "-c", WORKER], start_new_session=True)
    Path(sys.argv[1]).write_text(str(worker.pid))
    launcher_waits_for_ever()
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_hanging_run_is_stopped_with_its_workers_and_shows_their_stacks(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(textwrap.dedent(HANGING_LAUNCHER))
    worker_pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        launch.run_script(script, str(worker_pid_file), timeout=10)  # the worker is well inside its loop by then
    message = str(failure.value)
    assert "did not finish in 10 s" in message
    # faulthandler's report of each process, whole (they share one pipe): the function each one was waiting in, the
    # worker's before its launcher's.
    worker_report = message.find("in worker_waits_for_ever\n")
    launcher_report = message.find("in launcher_waits_for_ever\n")
    assert 0 <= worker_report < launcher_report, message[-3000:]
    worker = int(worker_pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), "the worker outlived its launcher's timeout"
    assert time.monotonic() - started < 60


def test_a_run_that_finishes_returns_its_output(tmp_path):
    script = tmp_path / "prints.py"
    script.write_text(
        "import os, sys\nprint('out', os.environ['PYTHONFAULTHANDLER'])\nprint('err', file=sys.stderr)\n"
    )
    result = launch.run_script(script)
    assert (result.returncode, result.stdout, result.stderr) == (0, "out 1\n", "err\n")


def test_a_run_that_fails_raises_with_its_output(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('what went wrong', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match="exited with 3(.|\n)*what went wrong"):
        launch.run_script(script)
    assert launch.run_script(script, expect_failure=True).returncode == 3
