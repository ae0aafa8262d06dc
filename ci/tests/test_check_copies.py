"""Tests of ci/check_copies.py against throwaway trees under tmp_path, and of the hook configuration using it."""

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml


CI_DIR = Path(__file__).resolve().parent.parent
SCRIPT = CI_DIR / "check_copies.py"
HEADER = "# Copied from models/m/modeling.py — edit the source, then run ci/check_copies.py --fix\n"
SOURCE = "import torch\n\n\ndef forward(x):\n    return torch.relu(x)\n"


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True, timeout=60
    )


def write(root: Path, rel: str, text: str | bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def repo(tmp_path):
    write(tmp_path, "models/m/modeling.py", SOURCE)
    write(tmp_path, "models/m/tokenizer/vocab.json", '{"a": 0}')
    write(tmp_path, "models/m/tokenizer/config.json", '{"lower": true}')
    return tmp_path


def test_copies_in_sync_pass(repo):
    write(repo, "recipes/r/modeling.py", HEADER + SOURCE)
    write(repo, "recipes/r/ascii_dash.py", "# Copied from models/m/modeling.py - see the source\n" + SOURCE)
    write(repo, "recipes/r/bare.py", "# Copied from models/m/modeling.py\n" + SOURCE)
    write(repo, "recipes/r/unrelated.py", "# Not a copy.\n# Copied from models/m/modeling.py\n" + SOURCE + "X = 1\n")
    proc = run(repo)
    assert proc.returncode == 0, proc.stdout
    assert "3 copies in sync" in proc.stdout


def test_drifted_copy_fails_with_a_diff(repo):
    write(repo, "recipes/r/modeling.py", HEADER + SOURCE.replace("relu", "gelu"))
    write(repo, "recipes/s/modeling.py", HEADER + SOURCE + "\n# local tweak\n")
    proc = run(repo)
    assert proc.returncode == 1
    assert "DRIFT   recipes/r/modeling.py differs from models/m/modeling.py" in proc.stdout
    assert "-    return torch.relu(x)" in proc.stdout and "+    return torch.gelu(x)" in proc.stdout
    assert "recipes/s/modeling.py" in proc.stdout  # every drifted copy is listed, not just the first


def test_orphan_copy_fails(repo):
    write(repo, "recipes/r/collator.py", "# Copied from models/m/collator.py — edit the source\nX = 1\n")
    proc = run(repo)
    assert proc.returncode == 1
    assert "ORPHAN  recipes/r/collator.py: its source models/m/collator.py does not exist" in proc.stdout
    assert run(repo, "--fix").returncode == 1  # nothing to fix it from


def test_fix_rewrites_copies_and_keeps_the_header(repo):
    ascii_header = "# Copied from models/m/modeling.py - edit the source\n"
    write(repo, "recipes/r/modeling.py", HEADER + "stale\n")
    write(repo, "recipes/s/modeling.py", ascii_header + SOURCE + "extra = 1\n")
    fixed = run(repo, "--fix")
    assert fixed.returncode == 0, fixed.stdout
    assert (repo / "recipes/r/modeling.py").read_text(encoding="utf-8") == HEADER + SOURCE
    assert (repo / "recipes/s/modeling.py").read_text(encoding="utf-8") == ascii_header + SOURCE
    assert run(repo).returncode == 0


def test_header_after_a_shebang(repo):
    script = "#!/usr/bin/env python3\nprint('hi')\n"
    header = "# Copied from models/m/run.py — edit the source, then run ci/check_copies.py --fix\n"
    write(repo, "models/m/run.py", script)
    write(repo, "recipes/r/run.py", "#!/usr/bin/env python3\n" + header + "print('hi')\n")
    assert run(repo).returncode == 0
    write(repo, "models/m/run.py", script + "print('bye')\n")
    assert run(repo).returncode == 1
    assert run(repo, "--fix").returncode == 0
    assert (repo / "recipes/r/run.py").read_text(encoding="utf-8") == (
        "#!/usr/bin/env python3\n" + header + "print('hi')\nprint('bye')\n"
    )


def test_manifest_file_entry(repo):
    entry = '[[copy]]\nsource = "models/m/tokenizer/vocab.json"\ntarget = "recipes/r/vocab.json"\n'
    write(repo, "ci/copies.toml", entry)
    missing = run(repo)
    assert missing.returncode == 1 and "MISSING recipes/r/vocab.json" in missing.stdout
    write(repo, "recipes/r/vocab.json", '{"a": 0}')
    assert run(repo).returncode == 0
    write(repo, "recipes/r/vocab.json", '{"a": 1}')
    drifted = run(repo)
    assert drifted.returncode == 1 and "DRIFT   recipes/r/vocab.json" in drifted.stdout
    assert run(repo, "--fix").returncode == 0
    assert (repo / "recipes/r/vocab.json").read_text() == '{"a": 0}'


def test_manifest_directory_entry_mirrors_the_source(repo):
    write(repo, "ci/copies.toml", '[[copy]]\nsource = "models/m/tokenizer"\ntarget = "recipes/r/tokenizer"\n')
    write(repo, "recipes/r/tokenizer/vocab.json", '{"a": 0}')
    write(repo, "recipes/r/tokenizer/old.json", "{}")
    proc = run(repo)
    assert proc.returncode == 1
    assert "MISSING recipes/r/tokenizer/config.json" in proc.stdout
    assert "EXTRA   recipes/r/tokenizer/old.json" in proc.stdout
    assert run(repo, "--fix").returncode == 0
    assert sorted(p.name for p in (repo / "recipes/r/tokenizer").iterdir()) == ["config.json", "vocab.json"]
    source, target = repo / "models/m/tokenizer/config.json", repo / "recipes/r/tokenizer/config.json"
    assert target.read_bytes() == source.read_bytes()
    assert run(repo).returncode == 0


def test_two_mirrored_sources_may_share_a_target_directory(repo):
    """A recipe training two models keeps both packages' model_configs/ in one folder: neither file is EXTRA to the
    other's mirror, but a file from neither still is."""
    write(repo, "models/a/configs/small/config.json", '{"a": 1}')
    write(repo, "models/b/configs/large/config.json", '{"b": 2}')
    manifest = "".join(
        f'[[copy]]\nsource = "models/{name}/configs"\ntarget = "recipes/r/configs"\n\n' for name in ("a", "b")
    )
    write(repo, "ci/copies.toml", manifest)
    assert run(repo, "--fix").returncode == 0
    assert run(repo).returncode == 0
    write(repo, "recipes/r/configs/stray/config.json", "{}")
    proc = run(repo)
    assert proc.returncode == 1 and "EXTRA   recipes/r/configs/stray/config.json" in proc.stdout


def test_manifest_with_missing_source_or_bad_entry_fails(repo):
    write(repo, "ci/copies.toml", '[[copy]]\nsource = "models/m/gone.json"\ntarget = "recipes/r/gone.json"\n')
    assert "ORPHAN  recipes/r/gone.json" in run(repo).stdout
    write(repo, "ci/copies.toml", '[[copy]]\nsource = "models/m/tokenizer"\n')
    proc = run(repo)
    assert proc.returncode == 1 and "needs string 'source' and 'target'" in proc.stdout


def test_excluded_folders_are_not_scanned(repo):
    stale = "# Copied from models/m/modeling.py\nstale\n"
    for folder in (".venv/lib", ".gpu", "recipes/r/__pycache__"):
        write(repo, f"{folder}/modeling.py", stale)
    assert run(repo).returncode == 0


def test_git_tree_checks_untracked_copies_but_not_ignored_ones(repo):
    write(repo, ".gitignore", "outputs/\n")
    write(repo, "outputs/run1/modeling.py", "# Copied from models/m/modeling.py\nstale\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    assert run(repo).returncode == 0
    write(repo, "recipes/r/modeling.py", "# Copied from models/m/modeling.py\nstale\n")  # untracked, not ignored
    assert run(repo).returncode == 1


def test_repo_manifest_parses_and_precommit_pins_match():
    root = CI_DIR.parent
    with open(CI_DIR / "copies.toml", "rb") as fh:
        assert isinstance(tomllib.load(fh).get("copy", []), list)
    config = yaml.safe_load((root / ".pre-commit-config.yaml").read_text())
    repos = {repo["repo"]: repo for repo in config["repos"]}
    ruff_pin = next(
        line.split("==")[1].strip()
        for line in (CI_DIR / "requirements-cpu.txt").read_text().splitlines()
        if line.startswith("ruff==")
    )
    # The hook and CI's `.venv/bin/ruff` must be the same ruff, or they disagree on formatting.
    assert repos["https://github.com/astral-sh/ruff-pre-commit"]["rev"] == f"v{ruff_pin}"
    local_hooks = {hook["id"]: hook for hook in repos["local"]["hooks"]}
    assert local_hooks["check-copies"]["entry"].endswith("ci/check_copies.py")
    assert local_hooks["check-copies"]["pass_filenames"] is False


def test_copies_come_from_common_or_their_model_package(repo):
    """No recipe is another recipe's library, no model package another's, and no copy is copied again."""
    write(repo, "common/packing.py", SOURCE)
    write(repo, "recipes/r/modeling.py", HEADER + SOURCE)  # a recipe carries its model's code: allowed
    write(repo, "models/m/m_pkg/packing.py", "# Copied from common/packing.py\n" + SOURCE)
    write(repo, "models/m/tests/helpers.py", "# Copied from models/m/modeling.py\n" + SOURCE)  # within one package
    proc = run(repo)
    assert proc.returncode == 0, proc.stdout

    write(repo, "recipes/r/collator.py", "import numpy\n")
    write(repo, "recipes/s/collator.py", "# Copied from recipes/r/collator.py\nimport numpy\n")
    write(repo, "models/n/modeling.py", "# Copied from models/m/modeling.py\n" + SOURCE)
    write(repo, "recipes/s/packing.py", "# Copied from models/m/m_pkg/packing.py\n" + SOURCE)
    write(repo, "ci/registry.py", "X = 1\n")
    write(repo, "recipes/s/conftest.py", "# Copied from ci/registry.py\nX = 1\n")
    proc = run(repo)
    assert proc.returncode == 1
    out = proc.stdout
    assert "SOURCE  recipes/s/collator.py is copied from recipes/r/collator.py: copies come from common/" in out
    assert "SOURCE  models/n/modeling.py is copied from models/m/modeling.py: one model package copies" in out
    assert "SOURCE  recipes/s/packing.py is copied from models/m/m_pkg/packing.py: its source is itself a copy" in out
    assert "SOURCE  recipes/s/conftest.py is copied from ci/registry.py: copies come from common/" in out
    assert out.count("SOURCE  ") == 4
