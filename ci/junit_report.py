"""What a pytest JUnit XML report says: the counts, and which tests failed with what, by pytest id.

Used by ``build_and_test.py``; like it, standard library only (it runs before the virtual environment exists).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


def parse_junit(path: Path) -> tuple[int, int, int] | None:
    """(passed, failed, skipped) from a pytest JUnit XML report; errors count as failures."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


FAILURE_TAIL_LINES = 12  # of each failure's report, printed again at the end of the log
FAILURES_WITH_TAILS = 3


@dataclass
class FailedTest:
    node_id: str | None  # pytest's id relative to the component folder (``tests/test_x.py::test_y[a]``); None: unknown
    description: str  # ``classname::name: first line of the message`` (and, for the first few, the report's end)


def failed_tests(path: Path, component_path: Path) -> list[FailedTest]:
    """The failed or erroring test cases of a JUnit report. Their descriptions are for the end of a long CI log
    (often all that a CI page shows); the first few also get the last lines of their report, where a launched
    script's failure leaves the end of its stderr."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    failures = []
    for case in root.iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is None:
            continue
        classname, name = case.get("classname", ""), case.get("name", "")
        message = (problem.get("message") or problem.text or "").strip().splitlines()
        test = f"{classname}::{name}" if classname else name
        description = f"{test}: {message[0][:200] if message else problem.tag}"
        if len(failures) < FAILURES_WITH_TAILS:
            tail = (problem.text or "").rstrip().splitlines()[-FAILURE_TAIL_LINES:]
            description += "".join(f"\n      | {line[:300]}" for line in tail)
        failures.append(FailedTest(node_id(component_path, classname, name), description))
    return failures


def node_id(component_path: Path, classname: str, name: str) -> str | None:
    """pytest's id of a JUnit test case: ``tests.test_x.TestGroup`` + ``test_y[a]`` is
    ``tests/test_x.py::TestGroup::test_y[a]`` when ``tests/test_x.py`` is a file of the component; else None (a
    collection error has no test function to name)."""
    parts = [part for part in classname.split(".") if part]
    if not parts or not name:
        return None
    for split in range(len(parts), 0, -1):  # the longest dotted prefix that is a module file
        module = Path(*parts[:split]).with_suffix(".py")
        if (component_path / module).is_file():
            return "::".join([module.as_posix(), *parts[split:], name])
    return None
