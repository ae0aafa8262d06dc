"""common/tests/launch.py (copied into every recipe's tests): a launched run that hangs is stopped with every process
under it, and the failure shows where each Python process was."""

import importlib.util
import logging
import os
import sys
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


# ------------------------------------------------------------------------------------------- run_in_process


def test_in_process_run_reads_like_a_subprocess_and_leaves_this_process_as_it_was(tmp_path):
    script = tmp_path / "user_error.py"
    script.write_text(
        "import logging, os, sys\n"
        "print('argv', sys.argv[1:], os.getcwd() == os.environ['EXPECTED_CWD'])\n"
        "os.environ['LEFT_BEHIND'] = '1'\n"
        "os.chdir('/')\n"
        "logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))\n"
        "print('error: dataset.path matches no file', file=sys.stderr)\n"
        "sys.exit(2)\n"
    )
    before = (dict(os.environ), list(sys.argv), os.getcwd(), logging.getLogger().handlers[:])
    result = launch.run_in_process(script, "a=1", env={"EXPECTED_CWD": str(launch.RECIPE_DIR)}, expect_failure=True)
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "argv ['a=1'] True\n",
        "error: dataset.path matches no file\n",
    )
    assert launch.assert_user_error(result, "matches no file")
    assert (dict(os.environ), list(sys.argv), os.getcwd(), logging.getLogger().handlers[:]) == before
    with pytest.raises(AssertionError, match="in process. exited with 2(.|\n)*matches no file"):
        launch.run_in_process(script, env={"EXPECTED_CWD": ""})


def test_in_process_run_with_an_uncaught_exception_exits_1_with_the_traceback(tmp_path):
    script = tmp_path / "bug.py"
    script.write_text("def build():\n    raise KeyError('a bug, not a user error')\nbuild()\n")
    result = launch.run_in_process(script, expect_failure=True)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "KeyError: 'a bug, not a user error'" in result.stderr
    with pytest.raises(AssertionError, match="Traceback"):
        launch.assert_user_error(result)


def test_in_process_os_exit_ends_the_run_and_a_forked_child_still_exits(tmp_path):
    """A finished CPU run leaves through os._exit (distributed.cleanup_distributed): the test process must survive it,
    and a child forked during the run (as a data-loader worker is) must really exit instead of running on."""
    script = tmp_path / "exits.py"
    child_log = tmp_path / "child.log"
    script.write_text(
        "import os\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        f"    open({str(child_log)!r}, 'w').write('the child exited')\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "print('done')\n"
        "os._exit(0)\n"
    )
    test_process = os.getpid()
    result = launch.run_in_process(script)
    if os.getpid() != test_process:  # the child came back from os._exit into this test: what must not happen
        child_log.write_text("the child ran on into the test")
        os._exit(0)
    assert (result.returncode, result.stdout) == (0, "done\n")
    assert child_log.read_text() == "the child exited"
