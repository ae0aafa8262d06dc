#!/usr/bin/env python3
"""The CI contract: run the tests of every component, in Docker where an engine answers, else locally.

A component is a folder under ``models/`` or ``recipes/`` that has tests (a ``tests/`` folder or ``test_*.py``
files), plus ``ci`` itself (tests in ``ci/tests``), so the tooling tests itself.

Modes (chosen automatically; force one with ``--docker`` or ``--local``):

- docker: ``docker build -t <component> .`` and ``docker run --rm --gpus all <component> pytest -v .`` in each
  component that has a Dockerfile, when ``docker info`` succeeds. Components without a Dockerfile run locally.
- local: the project virtual environment (``.venv`` at the repo root, created if missing, re-installed only
  when ci/requirements-cpu.txt, ci/constraints-cpu.txt or a model's pyproject.toml changed), one pytest
  run per component with the component folder as working directory and rootdir, so flat modules with the
  same name in different recipes never meet in one interpreter. On a machine without a GPU each run spreads
  its tests over pytest-xdist worker processes (``--workers``; default one per core, at most 4): most tests
  launch a training script, and a one-process launch leaves the second of two cores idle (two workers make
  the CPU suite about 1.5x faster on 2 cores). Where ``nvidia-smi`` answers, tests run one at a time,
  because GPU tests share the devices.

Examples::

    python3 ci/build_and_test.py --local                      # what CI runs
    python3 ci/build_and_test.py --list
    python3 ci/build_and_test.py --components esm2,ci -m "not slow"
    python3 ci/build_and_test.py --changed-only --base origin/main
    .venv/bin/python ci/build_and_test.py --no-install --components ci
    python3 ci/build_and_test.py --gpu                        # every GPU-marked test, on a GPU machine

The last line printed is always ``N passed, N failed`` (plus ``, N skipped`` when tests were skipped). A
component that times out, cannot be collected, or collects no tests although it has test files counts as at
least one failure there, and makes the exit status non-zero. In local mode a component's few failed tests (at most
MAX_RERUN_FAILURES) run once more, alone; if they pass then, the summary lists them as flaky and the component
passes (``--no-rerun``: no second run).

This file uses only the standard library: it has to run before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from junit_report import FailedTest, failed_tests, parse_junit


REPO_ROOT = Path(__file__).resolve().parent.parent
COMPONENT_PARENTS = ("models", "recipes")
SKIP_DIRS = {".venv", ".git", ".gpu", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}
REQUIREMENTS = "ci/requirements-cpu.txt"
CONSTRAINTS = "ci/constraints-cpu.txt"
REPORTS_DIR = "ci/reports"
STAMP_NAME = ".ci-install-stamp"
# Root files whose change cannot alter any test outcome; every other root file counts as configuration.
ROOT_DOC_SUFFIXES = (".md", ".rst")
ROOT_DOC_NAMES = {"LICENSE", "NOTICE", "CODEOWNERS"}
MAX_DEFAULT_WORKERS = 4  # each test may launch 2 ranks of ~1 GB: more workers buy little and cost memory
STOP_GRACE_S = 10  # after SIGINT, how long pytest gets to write its report before SIGKILL
# The hardware markers of common/conftest.py (every marker but ``slow``); --gpu selects tests carrying any.
GPU_MARKERS = ("requires_gpu", "requires_te", "requires_fp8", "requires_multi_gpu", "requires_blackwell")


@dataclass
class Component:
    name: str
    path: Path  # absolute
    rel: str  # relative to the repo root, POSIX style

    @property
    def has_test_files(self) -> bool:
        return any(_test_files(self.path))

    @property
    def has_dockerfile(self) -> bool:
        return (self.path / "Dockerfile").is_file()


@dataclass
class Result:
    component: str
    passed: int
    failed: int
    skipped: int
    seconds: float
    status: str
    ok: bool
    failures: tuple[str, ...] = ()  # what failed: the test's id, the first line of its message (and its report's end)
    flaky: tuple[str, ...] = ()  # the same, for tests that failed and then passed when run once more


# ---------------------------------------------------------------------------------------------------- discovery


def _walk_files(folder: Path):
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for filename in sorted(filenames):
            yield Path(dirpath) / filename


def _test_files(folder: Path):
    return (p for p in _walk_files(folder) if p.suffix == ".py" and p.name.startswith("test_"))


def discover(root: Path) -> list[Component]:
    """Every models/* and recipes/* folder with tests, then ``ci`` if it has ci/tests."""
    folders = []
    for parent in COMPONENT_PARENTS:
        base = root / parent
        if not base.is_dir():
            continue
        for folder in sorted(base.iterdir()):
            if not folder.is_dir() or folder.name.startswith(".") or folder.name in SKIP_DIRS:
                continue
            if (folder / "tests").is_dir() or any(_test_files(folder)):
                folders.append(folder)
    if (root / "ci" / "tests").is_dir():
        folders.append(root / "ci")

    # Components are named by their folder; the relative path disambiguates a name used twice.
    names = [f.name for f in folders]
    components = []
    for folder in folders:
        rel = folder.relative_to(root).as_posix()
        name = folder.name if names.count(folder.name) == 1 else rel
        components.append(Component(name=name, path=folder, rel=rel))
    return components


# ---------------------------------------------------------------------------------------------------- selection


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def _ref_exists(root: Path, ref: str) -> bool:
    return _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode == 0


def changed_files(root: Path, base: str | None) -> list[str] | None:
    """Files changed since the merge base with ``base`` (committed, uncommitted and untracked).

    Returns None when no base can be found (a repository with a single commit), meaning "assume everything".
    """
    if base is None:
        base = next((ref for ref in ("origin/main", "HEAD~1") if _ref_exists(root, ref)), None)
        if base is None:
            print("--changed-only: no origin/main or HEAD~1 to compare with; selecting everything", file=sys.stderr)
            return None
    elif not _ref_exists(root, base):
        raise SystemExit(f"error: --base {base!r} is not a commit in {root}")
    merge_base = _git(root, "merge-base", base, "HEAD")
    since = merge_base.stdout.strip() if merge_base.returncode == 0 else base
    diff = _git(root, "diff", "--name-only", since)
    untracked = _git(root, "ls-files", "--others", "--exclude-standard")
    for proc in (diff, untracked):
        if proc.returncode != 0:
            raise SystemExit(f"error: git failed: {proc.stderr.strip()}")
    files = sorted(set(diff.stdout.splitlines()) | set(untracked.stdout.splitlines()))
    print(f"--changed-only: {len(files)} file(s) changed since {base} ({since[:12]})", file=sys.stderr)
    return files


def select_changed(components: list[Component], files: list[str] | None) -> list[Component]:
    """Components touched by ``files``; everything when ci/, .ci/ or a root config file changed."""
    if files is None:
        return components
    by_rel = {c.rel: c for c in components}
    touched = set()
    for file in files:
        parts = file.split("/")
        if parts[0] in ("ci", ".ci"):
            return components
        if len(parts) == 1:
            if parts[0] in ROOT_DOC_NAMES or parts[0].endswith(ROOT_DOC_SUFFIXES):
                continue
            return components
        if parts[0] in COMPONENT_PARENTS and len(parts) > 2 and f"{parts[0]}/{parts[1]}" in by_rel:
            touched.add(f"{parts[0]}/{parts[1]}")
    return [c for c in components if c.rel in touched]


def select_named(components: list[Component], names: str) -> list[Component]:
    wanted = [n.strip().rstrip("/") for n in names.split(",") if n.strip()]
    known = {c.name: c for c in components} | {c.rel: c for c in components}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"error: unknown component(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = {known[n].rel for n in wanted}
    return [c for c in components if c.rel in chosen]


# ----------------------------------------------------------------------------------------------- environments


def docker_available() -> bool:
    """True when a Docker engine answers; a docker CLI without a daemon does not count."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _editable_models(root: Path) -> list[Path]:
    base = root / "models"
    return sorted(p for p in base.iterdir() if (p / "pyproject.toml").is_file()) if base.is_dir() else []


def _install_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in [root / REQUIREMENTS, root / CONSTRAINTS] + [m / "pyproject.toml" for m in _editable_models(root)]:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
        digest.update(b"\0")
    return digest.hexdigest()


def _check_call(cmd: list[str], **kwargs) -> None:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def ensure_venv(root: Path, venv: Path) -> Path:
    """Create ``venv`` if missing and install the CPU requirements unless its stamp says they are current."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"Creating virtual environment {venv}", flush=True)
        _check_call([sys.executable, "-m", "venv", str(venv)])
    stamp = venv / STAMP_NAME
    digest = _install_digest(root)
    if stamp.is_file() and stamp.read_text().strip() == digest:
        print(f"Virtual environment {venv} is up to date", flush=True)
        return python
    env = dict(os.environ, PIP_CONSTRAINT=str(root / CONSTRAINTS))
    _check_call([str(python), "-m", "pip", "install", "-r", str(root / REQUIREMENTS)], env=env)
    for model in _editable_models(root):
        _check_call([str(python), "-m", "pip", "install", "--no-deps", "-e", str(model)], env=env)
    stamp.write_text(digest + "\n")
    return python


# -------------------------------------------------------------------------------------------------- running


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, sig)


def _run_step(cmd: list[str], cwd: Path, env: dict, timeout: float, container: str | None = None) -> int | None:
    """Run ``cmd`` in its own process group, output going straight to ours; None means it timed out."""
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 0.1))
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        if container is not None:  # killing the docker client would leave the container running
            subprocess.run(["docker", "kill", container], capture_output=True)
        # SIGINT first: pytest then writes its JUnit report for the tests that did finish.
        _signal_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers such as orphaned torchrun workers


# A component with more failed tests than this is broken, not flaky: its failures are not run again.
MAX_RERUN_FAILURES = 3


def _status(rc: int | None, component: Component, markexpr: str | None) -> tuple[str, bool]:
    if rc is None:
        return "TIMEOUT", False
    if rc == 0:
        return "PASS", True
    if rc == 1:
        return "FAIL", False
    if rc == 5:
        # Deselecting everything with -m is legitimate; collecting nothing from real test files is not.
        if markexpr or not component.has_test_files:
            return "NO TESTS", True
        return "ERROR (no tests collected)", False
    if rc in (2, 3, 4):
        return f"ERROR (pytest exit {rc})", False
    return f"ERROR (exit {rc})", False


def default_workers() -> int:
    """Test processes per component: one per core (at most MAX_DEFAULT_WORKERS), or one where a GPU is present."""
    if shutil.which("nvidia-smi") is not None:
        return 1  # GPU tests would share (and oversubscribe) the devices
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_WORKERS))


def xdist_args(workers: int) -> list[str]:
    """pytest-xdist's options for ``workers`` processes; "worksteal" rebalances when a few tests run long."""
    return ["-n", str(workers), "--dist", "worksteal"] if workers > 1 else []


def _local_env(venv: Path | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # stream output as it comes, even into a CI log pipe
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_component(component: Component, args, venv: Path | None, docker: bool, report: Path) -> Result:
    """Run one component's tests (in Docker or locally) and read its counts from the JUnit report."""
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)  # never count a stale report
    pytest_args = ["-v", "."] + (["-m", args.markexpr] if args.markexpr else [])
    env = _local_env(venv)
    python = str(venv / "bin" / "python") if venv is not None else sys.executable
    start = time.monotonic()

    if docker:
        tag = component.name.lower().replace("/", "-")
        rc = _run_step(["docker", "build", "-t", tag, "."], component.path, env, args.timeout)
        if rc != 0:
            status = "TIMEOUT (docker build)" if rc is None else f"BUILD FAILED (exit {rc})"
            return Result(component.name, 0, 1, 0, time.monotonic() - start, status, False)
        container = f"ci-{tag}-{os.getpid()}"
        # --ipc=host: PyTorch data loaders and NCCL need more shared memory than Docker's 64 MB default.
        cmd = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--name", container]
        cmd += ["-v", f"{report.parent}:/ci-reports", tag, "pytest", *pytest_args]
        cmd += [f"--junitxml=/ci-reports/{report.name}"]
        remaining = args.timeout - (time.monotonic() - start)
        rc = _run_step(cmd, component.path, env, remaining, container=container)
    else:
        # The component folder is both working directory and rootdir, so its flat modules import as top-level
        # names (``python -m pytest`` puts the working directory on sys.path) without meeting another's.
        cmd = [python, "-m", "pytest", *pytest_args, *xdist_args(args.workers), "--rootdir", str(component.path)]
        cmd += [f"--junitxml={report}", "-o", f"junit_suite_name={component.name}"]
        rc = _run_step(cmd, component.path, env, args.timeout)

    status, ok = _status(rc, component, args.markexpr)
    if rc is None:
        status = f"TIMEOUT (> {args.timeout:g}s)"
    passed, failed, skipped = parse_junit(report) or (0, 0, 0)
    failures = failed_tests(report, component.path)
    flaky: list[FailedTest] = []
    if rc == 1 and not docker and args.rerun:
        rerun = rerun_failures(
            component, args, python, env, failures, report, args.timeout - (time.monotonic() - start)
        )
        if rerun is True:
            flaky, failures = failures, []
            flaky_tests = len({failure.node_id for failure in flaky})
            passed, failed, ok = passed + flaky_tests, 0, True
            status = f"PASS ({flaky_tests} flaky)"
        elif rerun is False:
            status = "FAIL (failed again when run alone)"
    if not ok:
        failed = max(failed, 1)  # the component itself failed even if no test case says so
    seconds = time.monotonic() - start
    return Result(
        component.name, passed, failed, skipped, seconds, status, ok,
        failures=tuple(failure.description for failure in failures),
        flaky=tuple(failure.description for failure in flaky),
    )  # fmt: skip


def rerun_failures(
    component: Component, args, python: str, env: dict, failures: list[FailedTest], report: Path, timeout: float
) -> bool | None:
    """Run a component's few failed tests once more, alone, one after another, in a fresh pytest process: True if
    every one passes (the failures were flaky: a rare crash of a launched process, say), False if not, None when
    they are not run again (more than MAX_RERUN_FAILURES of them, or one without a test id: a collection error).

    Rare failures that no local run repeats have failed whole CI runs here: a launched two-rank gloo run that aborted
    in C++ with nothing of ours on its stack, and a test of a component that nothing had changed. A real failure
    fails twice. The summary names flaky tests, with their first failure, so that they can be looked into."""
    ids = list(dict.fromkeys(failure.node_id for failure in failures))  # a failed test can also error in teardown
    if not ids or len(ids) > MAX_RERUN_FAILURES or None in ids:
        return None
    print(f"----- {component.name}: {len(ids)} failed; running {'it' if len(ids) == 1 else 'them'} once more, alone")
    rerun_report = report.with_name(report.stem + ".rerun.xml")
    rerun_report.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-v", *ids, *(["-m", args.markexpr] if args.markexpr else [])]
    cmd += ["--rootdir", str(component.path), f"--junitxml={rerun_report}"]
    rc = _run_step(cmd, component.path, env, timeout)
    counts = parse_junit(rerun_report)
    return rc == 0 and counts is not None and counts[:2] == (len(ids), 0)


def totals_line(results: list[Result]) -> str:
    passed = sum(r.passed for r in results)
    failed = sum(r.failed for r in results)
    skipped = sum(r.skipped for r in results)
    return f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")


def print_summary(results: list[Result]) -> None:
    width = max([len("component")] + [len(r.component) for r in results])
    header = f"{'component':<{width}}  {'passed':>6}  {'failed':>6}  {'skipped':>7}  {'seconds':>8}  status"
    print("\n" + "=" * len(header) + "\nSummary\n" + header + "\n" + "-" * len(header))
    for r in results:
        print(f"{r.component:<{width}}  {r.passed:>6}  {r.failed:>6}  {r.skipped:>7}  {r.seconds:>8.1f}  {r.status}")
    print("-" * len(header))
    flaky = [f"{r.component}: {failure}" for r in results for failure in r.flaky]
    if flaky:
        print("Flaky tests (failed, then passed when run again alone; their first failure, to look into):")
        print("\n".join(f"  {failure}" for failure in flaky))
    failures = [f"{r.component}: {failure}" for r in results for failure in r.failures]
    if failures:
        print("Failed tests (the full reports are in the log above and in " + REPORTS_DIR + "/):")
        print("\n".join(f"  {failure}" for failure in failures))


# ----------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--docker", action="store_true", help="build and test in Docker (needs an engine)")
    mode.add_argument("--local", action="store_true", help="test in the project virtual environment")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this repo)")
    parser.add_argument("--venv", type=Path, help="virtual environment to create/reuse (default: ROOT/.venv)")
    parser.add_argument("--no-install", action="store_true", help="local mode with the current interpreter")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="every GPU-marked test, with the current interpreter (--local --no-install -m '<hardware markers>'); "
        "fails if none ran",
    )
    parser.add_argument("--setup-only", action="store_true", help="create/update the virtual environment, then exit")
    parser.add_argument("--components", help="comma-separated component names (or paths) to test")
    parser.add_argument("--changed-only", action="store_true", help="only components changed since --base")
    parser.add_argument("--base", help="git ref for --changed-only (default: origin/main, else HEAD~1)")
    parser.add_argument("-m", dest="markexpr", metavar="MARKEXPR", help="pytest marker expression")
    # A guard against a hung suite, not a speed target (that is ~10 minutes per component on 2 cores, docs/testing.md):
    # CI's 2-core machine has run a suite at 1.4x its local time, and a suite stopped at the guard fails CI.
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per component, against hangs (default: 1800)"
    )
    parser.add_argument("--list", action="store_true", help="print the selected components and exit")
    parser.add_argument(
        "--no-rerun",
        dest="rerun",
        action="store_false",
        help=f"fail on a test's first failure (default, local mode: a component's failed tests, up to "
        f"{MAX_RERUN_FAILURES}, run once more alone; passing then, they are reported as flaky)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="local mode: pytest-xdist processes per component (default: one per core, at most "
        f"{MAX_DEFAULT_WORKERS}; 1 where nvidia-smi answers or with --gpu); 1 runs the tests one after another",
    )
    args = parser.parse_args(argv)
    if args.gpu:
        if args.docker or args.setup_only or args.venv or args.markexpr:
            parser.error("--gpu cannot be combined with --docker, --setup-only, --venv or -m")
        args.local = args.no_install = True
        args.markexpr = " or ".join(GPU_MARKERS)
    if args.no_install and (args.docker or args.setup_only or args.venv):
        parser.error("--no-install cannot be combined with --docker, --setup-only or --venv")
    if args.base and not args.changed_only:
        parser.error("--base only makes sense with --changed-only")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.workers is None:
        args.workers = 1 if args.gpu else default_workers()
    if args.workers > 1 and args.no_install and importlib.util.find_spec("xdist") is None:
        # The project venv has pytest-xdist (ci/requirements-cpu.txt); another interpreter may not.
        print(f"note: pytest-xdist is not installed in {sys.executable}: tests run one at a time", file=sys.stderr)
        args.workers = 1
    args.root = args.root.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.root
    venv = (args.venv or root / ".venv").absolute()
    if args.setup_only:
        ensure_venv(root, venv)
        return 0

    components = discover(root)
    if args.components:
        components = select_named(components, args.components)
    if args.changed_only:
        components = select_changed(components, changed_files(root, args.base))

    if args.list:
        for c in components:
            print(f"{c.name}\t{c.rel}")
        return 0
    if not components:
        print("No components to test (nothing with tests under models/, recipes/ or ci/ was selected).")
        print(totals_line([]))
        return 0

    docker = not args.no_install and (args.docker or (not args.local and docker_available()))
    if args.docker and not docker_available():
        print("error: --docker given but no Docker engine answers `docker info`", file=sys.stderr)
        return 2
    workers = f" ({args.workers} test processes per local component)" if args.workers > 1 else ""
    names = ", ".join(c.name for c in components)
    print(f"Mode: {'docker' if docker else 'local'}{workers}; components: {names}", flush=True)

    # The venv is needed unless every selected component runs in Docker (ci/ has no Dockerfile, for one).
    use_venv = None
    if not args.no_install and not (docker and all(c.has_dockerfile for c in components)):
        ensure_venv(root, venv)
        use_venv = venv

    results = []
    for index, component in enumerate(components, 1):
        in_docker = docker and component.has_dockerfile
        where = "docker" if in_docker else "local"
        print(f"\n===== [{index}/{len(components)}] {component.name} ({component.rel}, {where}) =====", flush=True)
        report = root / REPORTS_DIR / f"{component.name.replace('/', '__')}.xml"
        result = run_component(component, args, use_venv, in_docker, report)
        print(f"----- {component.name}: {result.status} in {result.seconds:.1f}s", flush=True)
        results.append(result)

    print_summary(results)
    ok = all(r.ok for r in results)
    if args.gpu and not any(r.passed or r.failed for r in results):
        # Every GPU test skipped (no CUDA device, or TE missing): a green run here would prove nothing.
        print("error: --gpu ran no test (all skipped: see the skip reasons above); is this a GPU machine with TE?")
        ok = False
    print(totals_line(results), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
