"""Tests of ci/build_and_test.py, run as CI runs it (a subprocess) against throwaway trees under tmp_path."""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest


SCRIPT = Path(__file__).resolve().parent.parent / "build_and_test.py"

PASSING = "def test_one():\n    assert 1 + 1 == 2\n"


def make_component(root: Path, rel: str, files: dict[str, str] | None = None) -> Path:
    folder = root / rel
    for name, text in (files or {"tests/test_x.py": PASSING}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def run_ci(
    root: Path, *args: str, timeout: float = 120, install: bool = False, env=None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *([] if install else ["--no-install"]), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.rstrip("\n").splitlines()[-1]


def listed(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split("\t")[0] for line in proc.stdout.splitlines()]


def test_discovery_finds_folders_with_tests_and_ci(tmp_path):
    make_component(tmp_path, "models/alpha")  # tests/ folder
    make_component(tmp_path, "recipes/beta_recipe", {"test_beta.py": PASSING})  # flat test file
    make_component(tmp_path, "models/no_tests", {"modeling.py": "X = 1\n"})
    make_component(tmp_path, "ci", {"tests/test_ci.py": PASSING})
    assert listed(run_ci(tmp_path, "--list")) == ["alpha", "beta_recipe", "ci"]


def test_duplicate_folder_names_are_named_by_path(tmp_path):
    make_component(tmp_path, "models/esm2")
    make_component(tmp_path, "recipes/esm2")
    assert listed(run_ci(tmp_path, "--list")) == ["models/esm2", "recipes/esm2"]


def test_zero_components_exits_zero(tmp_path):
    (tmp_path / "models").mkdir()
    proc = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No components" in proc.stdout
    assert last_line(proc) == "0 passed, 0 failed"


def test_components_option_selects_by_name_or_path(tmp_path):
    for name in ("a", "b", "c"):
        make_component(tmp_path, f"models/{name}")
    assert listed(run_ci(tmp_path, "--list", "--components", "c,models/a")) == ["a", "c"]
    unknown = run_ci(tmp_path, "--list", "--components", "a,nope")
    assert unknown.returncode != 0
    assert "nope" in unknown.stderr


def test_summary_counts_last_line_and_junit_reports(tmp_path):
    make_component(
        tmp_path,
        "models/alpha",
        {
            "tests/test_x.py": """
                import pytest

                def test_one():
                    assert 2 * 3 == 6

                def test_two():
                    assert "ab".upper() == "AB"

                @pytest.mark.skip(reason="not on this machine")
                def test_three():
                    raise AssertionError
            """
        },
    )
    make_component(tmp_path, "recipes/beta")
    proc = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # A header per component and pytest's own progress lines are streamed before the summary.
    # (pytest-xdist's workers print "[gw0] [ 33%] PASSED tests/test_x.py::test_one", one process "... PASSED")
    progress = re.search(r"^.*PASSED.*test_x\.py::test_one.*$|^.*test_x\.py::test_one PASSED.*$", out, re.MULTILINE)
    assert progress, out
    assert out.index("alpha (models/alpha") < progress.start() < out.index("Summary")
    table = {line.split()[0]: line.split() for line in out.split("Summary")[1].splitlines() if line.strip()}
    assert table["component"] == ["component", "passed", "failed", "skipped", "seconds", "status"]
    assert table["alpha"][1:4] == ["2", "0", "1"] and table["alpha"][5] == "PASS"
    assert table["beta"][1:4] == ["1", "0", "0"]
    assert last_line(proc) == "3 passed, 0 failed, 1 skipped"

    for name, tests in (("alpha", 3), ("beta", 1)):
        suite = ET.parse(tmp_path / "ci" / "reports" / f"{name}.xml").getroot().find("testsuite")
        assert suite is not None and int(suite.get("tests")) == tests


def test_failing_test_fails_the_run(tmp_path):
    make_component(
        tmp_path,
        "models/alpha",
        {"tests/test_x.py": PASSING + "\ndef test_bad():\n    assert [1, 2] == [2, 1]\n"},
    )
    proc = run_ci(tmp_path)
    assert proc.returncode == 1
    summary = proc.stdout.split("Summary")[1]
    assert "FAIL" in summary
    # The end of the log names the failed test and its message, for CI pages that show only the tail.
    assert "alpha: tests.test_x::test_bad: assert [1, 2] == [2, 1]" in summary, summary
    assert "test_one" not in summary
    assert "      | E       assert [1, 2] == [2, 1]" in summary, summary  # the end of its report
    assert "alpha: 1 failed; running it once more, alone" in proc.stdout
    assert "FAIL (failed again when run alone)" in summary
    assert last_line(proc) == "1 passed, 1 failed"


FLAKY_TESTS = """
    from pathlib import Path

    import pytest

    def test_one():
        assert 1 + 1 == 2

    class TestGroup:
        @pytest.mark.parametrize("case", ["first run fails"])
        def test_flaky(self, case):
            marker = Path(__file__).with_name("failed_once")
            if not marker.exists():
                marker.write_text("")
                raise AssertionError(case)
"""


def test_a_test_that_fails_once_passes_when_run_again_alone_and_is_reported_flaky(tmp_path):
    folder = make_component(tmp_path, "models/alpha", {"tests/test_x.py": FLAKY_TESTS})
    proc = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.split("Summary")[1]
    assert "PASS (1 flaky)" in summary
    flaky = summary.split("Flaky tests")[1]
    assert "alpha: tests.test_x.TestGroup::test_flaky[first run fails]: AssertionError: first run fails" in flaky
    assert "Failed tests" not in summary
    # Only the failed test ran again, by its pytest id (a class and a parameter in it).
    second_run = proc.stdout.split("alpha: 1 failed; running it once more, alone")[1].split("Summary")[0]
    assert "tests/test_x.py::TestGroup::test_flaky[first run fails] PASSED" in second_run
    assert "test_one" not in second_run
    rerun = ET.parse(tmp_path / "ci" / "reports" / "alpha.rerun.xml").getroot().find("testsuite")
    assert rerun is not None and (rerun.get("tests"), rerun.get("failures")) == ("1", "0")
    assert last_line(proc) == "2 passed, 0 failed"

    (folder / "tests" / "failed_once").unlink()
    strict = run_ci(tmp_path, "--no-rerun")
    assert strict.returncode == 1 and "once more" not in strict.stdout
    assert last_line(strict) == "1 passed, 1 failed"


def test_more_failures_than_a_flake_makes_are_not_run_again(tmp_path):
    many = "import pytest\n\n@pytest.mark.parametrize('n', range(4))\ndef test_bad(n):\n    assert n < 0\n"
    make_component(tmp_path, "models/alpha", {"tests/test_x.py": many})
    proc = run_ci(tmp_path)
    assert proc.returncode == 1 and "once more" not in proc.stdout
    summary = proc.stdout.split("Summary")[1]
    assert summary.count("alpha: tests.test_x::test_bad[") == 4
    assert last_line(proc) == "0 passed, 4 failed"


def test_collection_error_fails_the_run(tmp_path):
    make_component(tmp_path, "models/ok")
    make_component(tmp_path, "models/broken", {"tests/test_x.py": "import module_that_does_not_exist\n" + PASSING})
    proc = run_ci(tmp_path)
    assert proc.returncode == 1
    broken = next(line for line in proc.stdout.split("Summary")[1].splitlines() if line.startswith("broken"))
    # One pytest process exits 2 on a collection error; with pytest-xdist workers the error is a failed test (exit 1).
    assert broken.endswith(("ERROR (pytest exit 2)", "FAIL")), broken
    assert "once more" not in proc.stdout  # a module that cannot be imported is broken, not flaky
    assert "broken: tests.test_x: collection failure" in proc.stdout.split("Summary")[1] or "pytest exit 2" in broken
    assert last_line(proc) == "1 passed, 1 failed"


def test_test_files_without_tests_fail_but_a_bare_tests_folder_does_not(tmp_path):
    make_component(tmp_path, "models/empty_folder", {"tests/README.md": "tests come later\n"})
    assert run_ci(tmp_path).returncode == 0
    make_component(tmp_path, "models/no_tests_inside", {"tests/test_x.py": "VALUE = 1\n"})
    proc = run_ci(tmp_path)
    assert proc.returncode == 1
    assert "no tests collected" in proc.stdout.split("Summary")[1]


def test_all_skipped_component_passes(tmp_path):
    make_component(
        tmp_path,
        "recipes/gpu_only",
        {"tests/test_x.py": "import pytest\n\n@pytest.mark.skip(reason='no GPU')\ndef test_gpu():\n    pass\n"},
    )
    proc = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert last_line(proc) == "0 passed, 0 failed, 1 skipped"


def test_marker_expression_is_passed_to_pytest(tmp_path):
    tests = """
        import pytest

        @pytest.mark.slow
        def test_slow():
            pass

        def test_fast():
            pass
    """
    make_component(tmp_path, "models/alpha", {"tests/test_x.py": tests, "pytest.ini": "[pytest]\nmarkers = slow\n"})
    assert last_line(run_ci(tmp_path, "-m", "not slow")) == "1 passed, 0 failed"
    # Deselecting every test with -m is not an error.
    proc = run_ci(tmp_path, "-m", "slow and not slow")
    assert proc.returncode == 0, proc.stdout
    assert last_line(proc) == "0 passed, 0 failed"


GPU_TESTS = """
    import pytest

    @pytest.mark.requires_te
    def test_te():
        pass

    @pytest.mark.requires_multi_gpu
    @pytest.mark.skip(reason="requires_multi_gpu: 1 CUDA device(s), need 2")
    def test_two_gpus():
        pass

    def test_cpu():
        pass
"""
GPU_MARKERS_INI = "[pytest]\nmarkers =\n    requires_te\n    requires_multi_gpu\n"


def test_workers_spread_a_components_tests_over_processes(tmp_path):
    """--workers 2: the tests of one component run in two pytest-xdist processes and are counted once each;
    --workers 1: in the one pytest process."""
    make_component(
        tmp_path,
        "models/alpha",
        {
            "tests/test_x.py": """
                import os, time
                import pytest

                @pytest.mark.parametrize("index", range(4))
                def test_records_its_process(index):
                    time.sleep(1)  # long enough that the second worker gets work before the first finishes it all
                    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
                    with open(os.environ["PROCESS_LOG"], "a") as log:
                        log.write(f"{name} {os.getpid()}\\n")
            """
        },
    )
    # Not this test's own worker name, when CI runs it under pytest-xdist: the inner run must set its own.
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    for workers, expected in (("2", {"gw0", "gw1"}), ("1", {"main"})):
        log = tmp_path / f"processes_{workers}.log"
        proc = run_ci(tmp_path, "--workers", workers, env=dict(outer, PROCESS_LOG=str(log)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert last_line(proc) == "4 passed, 0 failed"
        lines = log.read_text().splitlines()
        assert len(lines) == 4 and {line.split()[0] for line in lines} == expected, lines
        assert len({line.split()[1] for line in lines}) == len(expected)
    assert run_ci(tmp_path, "--workers", "0").returncode == 2


def test_gpu_mode_runs_the_hardware_marked_tests_of_every_component(tmp_path):
    for name in ("models/alpha", "recipes/beta"):
        make_component(tmp_path, name, {"tests/test_x.py": GPU_TESTS, "pytest.ini": GPU_MARKERS_INI})
    proc = run_ci(tmp_path, "--gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Summary" in proc.stdout and "alpha" in proc.stdout and "beta" in proc.stdout  # per-component table
    assert last_line(proc) == "2 passed, 0 failed, 2 skipped"  # test_cpu deselected in both


def test_gpu_mode_fails_when_every_gpu_test_skips(tmp_path):
    tests = GPU_TESTS.replace(
        "def test_te", '@pytest.mark.skip(reason="requires_te: no CUDA device")\n    def test_te'
    )
    make_component(tmp_path, "models/alpha", {"tests/test_x.py": tests, "pytest.ini": GPU_MARKERS_INI})
    proc = run_ci(tmp_path, "--gpu")
    assert proc.returncode == 1, proc.stdout
    assert "--gpu ran no test" in proc.stdout
    assert last_line(proc) == "0 passed, 0 failed, 2 skipped"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_mode_selects_every_hardware_marker_of_the_registry():
    """--gpu's marker list and common/conftest.py's registry name the same hardware markers."""
    registry = _load(SCRIPT.parent.parent / "common" / "conftest.py").MARKERS
    assert set(_load(SCRIPT).GPU_MARKERS) == set(registry) - {"slow"}


def test_same_module_names_in_two_recipes_do_not_collide(tmp_path):
    for name in ("one", "two"):
        make_component(
            tmp_path,
            f"recipes/{name}",
            {
                "collator.py": f"NAME = {name!r}\n",
                "tests/test_collator.py": f"from collator import NAME\n\ndef test_name():\n    assert NAME == {name!r}\n",
            },
        )
    proc = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert last_line(proc) == "2 passed, 0 failed"


def test_timeout_kills_the_component_and_fails(tmp_path):
    pid_file = tmp_path / "pid"
    make_component(
        tmp_path,
        "models/sleepy",
        {
            "tests/test_x.py": f"""
                import os
                import time

                def test_sleeps():
                    with open({str(pid_file)!r}, "w") as fh:
                        fh.write(str(os.getpid()))
                    time.sleep(600)
            """
        },
    )
    make_component(tmp_path, "models/zippy")
    start = time.monotonic()
    # 20 s: room for pytest to start on a loaded two-core CI machine (with 3 s, zippy itself could time out there);
    # the sleeper's 600 s are stopped far sooner.
    proc = run_ci(tmp_path, "--timeout", "20", timeout=300)
    assert time.monotonic() - start < 240
    assert proc.returncode == 1
    summary = proc.stdout.split("Summary")[1]
    assert "TIMEOUT" in summary
    assert last_line(proc) == "1 passed, 1 failed"  # zippy still ran after sleepy was stopped
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def _git(root: Path, *args: str) -> None:
    env = dict(os.environ, GIT_AUTHOR_NAME="ci", GIT_AUTHOR_EMAIL="ci@example.com")
    env |= {"GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@example.com"}
    subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)


def test_changed_only_selects_components_changed_since_base(tmp_path):
    for rel in ("models/a", "models/b", "recipes/c"):
        make_component(tmp_path, rel)
    make_component(tmp_path, "ci", {"tests/test_ci.py": PASSING})
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Docs\n")
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "start")
    _git(tmp_path, "tag", "base")

    def changed(*extra: str) -> list[str]:
        return listed(run_ci(tmp_path, "--list", "--changed-only", *extra))

    assert changed("--base", "base") == []
    (tmp_path / "docs" / "index.md").write_text("# Docs, edited\n")
    (tmp_path / "models" / "b" / "modeling.py").write_text("X = 2\n")  # untracked file
    assert changed("--base", "base") == ["b"]

    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "edit b")
    (tmp_path / "recipes" / "c" / "tests" / "test_x.py").write_text(PASSING + "\n")  # uncommitted edit
    assert changed("--base", "base") == ["b", "c"]
    assert changed() == ["b", "c"]  # default base: HEAD~1, as there is no origin/main
    assert changed("--base", "base", "--components", "c,a") == ["c"]

    (tmp_path / "ci" / "tool.py").write_text("Y = 1\n")  # the tooling changed: test everything
    assert changed("--base", "base") == ["a", "b", "c", "ci"]

    bad = run_ci(tmp_path, "--list", "--changed-only", "--base", "no-such-ref")
    assert bad.returncode != 0


# A stand-in docker CLI: records its calls and, for `run`, writes the JUnit report pytest would have written.
FAKE_DOCKER = """#!{python}
import pathlib, sys
args = sys.argv[1:]
with open({log!r}, "a") as fh:
    fh.write(" ".join(args) + "\\n")
if args[0] == "run":
    host = next(a.split(":")[0] for a in args if a.endswith(":/ci-reports"))
    name = next(a.split("/")[-1] for a in args if a.startswith("--junitxml="))
    suite = '<testsuite name="pytest" tests="3" failures="0" errors="0" skipped="1"/>'
    pathlib.Path(host, name).write_text("<testsuites>" + suite + "</testsuites>")
"""


def test_docker_mode_builds_and_runs_each_component(tmp_path):
    log = tmp_path / "docker.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER.format(python=sys.executable, log=str(log)))
    (bin_dir / "docker").chmod(0o755)
    make_component(
        tmp_path / "repo", "recipes/Esm2_Fsdp", {"Dockerfile": "FROM scratch\n", "tests/test_x.py": PASSING}
    )
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    proc = run_ci(tmp_path / "repo", install=True, env=env)  # auto mode: `docker info` answers
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last_line(proc) == "2 passed, 0 failed, 1 skipped"
    calls = log.read_text().splitlines()
    assert calls[0] == "info"
    assert calls[1] == "build -t esm2_fsdp ."
    assert calls[2].startswith("run --rm --gpus all ") and " esm2_fsdp pytest -v . " in calls[2]

    # A docker CLI without an engine (as on CPU CI machines) is not Docker: --docker refuses to run.
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    down = run_ci(tmp_path / "repo", "--docker", install=True, env=env)
    assert down.returncode == 2 and "no Docker engine" in down.stderr
