#!/usr/bin/env python3
"""Fail when a copied file differs from its source; ``--fix`` rewrites the copies.

Recipes carry copies of shared code so that each recipe folder stands alone. Two ways to declare a copy:

1. A header as the file's first line (second line if the first is a ``#!`` shebang)::

       # Copied from models/esm2/modeling_esm_te.py — edit the source, then run ci/check_copies.py --fix

   The path is relative to the repository root; an ASCII ``-`` works as well as the em dash, and anything may
   follow the path. Without that header line the copy must equal its source byte for byte.

2. An entry in ci/copies.toml, for files that cannot carry a comment (JSON tokenizer files and the like)::

       [[copy]]
       source = "models/esm2/esm2_te/tokenizer"
       target = "recipes/esm2_native_te/tokenizer"

   A directory source is mirrored: the target directory must hold exactly the same files, besides the targets of
   other entries.

Where copies may come from (so that no folder becomes another's library): shared code has its one source in
``common/``; a recipe may also copy its model's own files (modeling code, tokenizer, configs) from ``models/<name>/``;
root files (LICENSE) may be copied anywhere. A copy never comes from a recipe, from ``ci/``, from another copy, or
from one model package into another.

Exit status: 0 when every copy is in sync, 1 when any copy drifted or its source is missing (after ``--fix``,
only the copies it could not repair count).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib


REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "ci/copies.toml"
SKIP_DIRS = {".venv", ".git", ".gpu", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}
HEADER_RE = re.compile(r"#\s*Copied from\s+(?P<source>\S+)")
MAX_DIFF_LINES = 40


@dataclass
class Copy:
    target: Path
    source: Path
    header: bytes | None = None  # the header line, with its line ending, for header-declared copies
    header_index: int = 0  # 0, or 1 after a shebang

    def expected(self) -> bytes:
        """What the copy should contain, given its source."""
        data = self.source.read_bytes()
        if self.header is None:
            return data
        lines = data.splitlines(keepends=True)
        at = self.header_index if lines and lines[0].startswith(b"#!") else 0
        if at and not lines[0].endswith((b"\n", b"\r")):
            lines[0] += b"\n"
        return b"".join(lines[:at] + [self.header] + lines[at:])


# ------------------------------------------------------------------------------------------------ finding copies


def _candidate_files(root: Path):
    """Tracked and untracked-but-not-ignored files when ``root`` is a git work tree, else a filtered walk."""
    git = shutil.which("git")
    if git and (root / ".git").exists():
        proc = subprocess.run(
            [git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True
        )
        if proc.returncode == 0:
            for rel in sorted(set(proc.stdout.decode().split("\0")) - {""}):
                if SKIP_DIRS.isdisjoint(rel.split("/")):
                    yield root / rel
            return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for filename in sorted(filenames):
            yield Path(dirpath) / filename


def _read_header(path: Path) -> tuple[int, bytes, str] | None:
    """(line index, header line, source path) when the file declares itself a copy."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:  # a dangling symlink, a file deleted since git listed it
        return None
    if b"Copied from" not in head:
        return None
    lines = head.splitlines(keepends=True)
    for index in (0, 1) if lines and lines[0].startswith(b"#!") else (0,):
        if index >= len(lines):
            break
        match = HEADER_RE.match(lines[index].decode("utf-8", errors="replace"))
        if match:
            return index, lines[index], match.group("source")
    return None


def header_copies(root: Path) -> list[Copy]:
    copies = []
    for path in _candidate_files(root):
        if path.is_symlink() or not path.is_file():
            continue
        found = _read_header(path)
        if found is not None:
            index, header, source = found
            copies.append(Copy(target=path, source=root / source, header=header, header_index=index))
    return copies


def _files_under(folder: Path) -> dict[str, Path]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for filename in filenames:
            path = Path(dirpath) / filename
            found[path.relative_to(folder).as_posix()] = path
    return found


def manifest_copies(root: Path) -> tuple[list[Copy], list[Path], list[str]]:
    """Copies listed in ci/copies.toml: (copies, files in mirrored targets that the source lacks, errors)."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        return [], [], []
    try:
        with open(manifest, "rb") as fh:
            entries = tomllib.load(fh).get("copy", [])
    except tomllib.TOMLDecodeError as exc:
        return [], [], [f"{MANIFEST}: {exc}"]
    copies, extras, errors = [], [], []
    for number, entry in enumerate(entries, 1):
        source, target = entry.get("source"), entry.get("target")
        if not isinstance(source, str) or not isinstance(target, str):
            errors.append(f"{MANIFEST}: entry {number} needs string 'source' and 'target'")
            continue
        source_path, target_path = root / source, root / target
        if source_path.is_dir():
            source_files = _files_under(source_path)
            copies += [Copy(target=target_path / rel, source=path) for rel, path in sorted(source_files.items())]
            if target_path.is_dir():
                extras += [p for rel, p in sorted(_files_under(target_path).items()) if rel not in source_files]
        else:  # a missing source is reported as an orphan by check()
            copies.append(Copy(target=target_path, source=source_path))
    # A mirrored directory may hold another entry's copy (model_configs/ of two model packages in one recipe).
    targets = {copy.target for copy in copies}
    extras = [path for path in extras if path not in targets]
    return copies, extras, errors


# ------------------------------------------------------------------------------------------------ checking


def _short_diff(expected: bytes, actual: bytes, source: str, target: str) -> str:
    diff = list(
        difflib.unified_diff(
            expected.decode("utf-8", errors="replace").splitlines(),
            actual.decode("utf-8", errors="replace").splitlines(),
            fromfile=source,
            tofile=target,
            lineterm="",
            n=1,
        )
    )
    if not diff:  # same text, different bytes (line endings, trailing newline, encoding)
        return "    (contents differ only in line endings or bytes that are not text)"
    more = len(diff) - MAX_DIFF_LINES
    shown = diff[:MAX_DIFF_LINES] + ([f"... ({more} more diff lines)"] if more > 0 else [])
    return "\n".join("    " + line for line in shown)


def source_rule_problem(source: str, target: str, copy_targets: set[str]) -> str | None:
    """Why ``source`` may not be the source of ``target`` (paths relative to the root), or None when it may."""
    if source in copy_targets or any(source.startswith(t + "/") for t in copy_targets):
        return "its source is itself a copy: copy from the original"
    source_parts, target_parts = source.split("/"), target.split("/")
    if len(source_parts) == 1 or source_parts[0] == "common":
        return None
    if source_parts[0] == "models" and len(source_parts) > 2:
        if target_parts[0] == "recipes":
            return None  # a recipe carries its model's modeling code, tokenizer and configs
        if target_parts[:2] == source_parts[:2]:
            return None
        return "one model package copies from another: move the shared file to common/"
    return f"copies come from common/ (or a model package, into recipes), not from {source_parts[0]}/"


def check(root: Path, fix: bool) -> int:
    root = root.resolve()
    copies, extras, problems = manifest_copies(root)
    copies = header_copies(root) + copies

    def rel(path: Path) -> str:
        return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)

    copy_targets = {rel(copy.target) for copy in copies}
    for copy in copies:
        why = source_rule_problem(rel(copy.source), rel(copy.target), copy_targets)
        if why is not None:
            problems.append(f"SOURCE  {rel(copy.target)} is copied from {rel(copy.source)}: {why}")

    fixed = 0
    for copy in copies:
        if not copy.source.is_file():
            problems.append(f"ORPHAN  {rel(copy.target)}: its source {rel(copy.source)} does not exist")
            continue
        expected = copy.expected()
        actual = copy.target.read_bytes() if copy.target.is_file() else None
        if actual == expected:
            continue
        if fix:
            copy.target.parent.mkdir(parents=True, exist_ok=True)
            copy.target.write_bytes(expected)
            fixed += 1
            print(f"fixed   {rel(copy.target)} from {rel(copy.source)}")
        elif actual is None:
            problems.append(f"MISSING {rel(copy.target)}: copy of {rel(copy.source)} does not exist")
        else:
            diff = _short_diff(expected, actual, rel(copy.source), rel(copy.target))
            problems.append(f"DRIFT   {rel(copy.target)} differs from {rel(copy.source)}:\n{diff}")
    for extra in extras:
        if fix:
            extra.unlink()
            fixed += 1
            print(f"removed {rel(extra)}: not in the mirrored source directory")
        else:
            problems.append(f"EXTRA   {rel(extra)}: in a mirrored directory but not in its source ({MANIFEST})")

    for problem in problems:
        print(problem)
    if problems:
        hint = "" if fix else " Edit the source, then run `python3 ci/check_copies.py --fix`."
        print(f"check_copies: {len(problems)} problem(s) in {len(copies)} copies.{hint}")
        return 1
    print(f"check_copies: {len(copies)} copies in sync" + (f" ({fixed} fixed)" if fixed else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", action="store_true", help="rewrite drifted copies from their sources")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this repo)")
    args = parser.parse_args(argv)
    return check(args.root, args.fix)


if __name__ == "__main__":
    sys.exit(main())
