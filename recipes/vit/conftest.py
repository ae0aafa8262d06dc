# Copied from common/conftest.py — edit the source, then run ci/check_copies.py --fix
"""The project's one registry of pytest markers, and the rule that skips them on machines without the hardware.

Every component (models/*, recipes/*) carries a synced copy of this file as its top-level ``conftest.py``, so a
copied recipe folder keeps working on its own. Component-specific fixtures belong in ``tests/conftest.py``.

Markers:
    requires_gpu        needs at least one CUDA device
    requires_te         needs TransformerEngine importable and a CUDA device
    requires_fp8        needs FP8 tensor cores (compute capability >= 8.9, Ada/Hopper) and TransformerEngine
    requires_multi_gpu  needs at least two CUDA devices
    requires_blackwell  needs compute capability >= 10.0 (MXFP8, NVFP4) and TransformerEngine
    slow                long-running; skipped unless ``--run-slow`` is given or ``RUN_SLOW=1`` is set
"""

import functools
import importlib.util
import os

import pytest


MARKERS = {
    "requires_gpu": "needs at least one CUDA device",
    "requires_te": "needs TransformerEngine and a CUDA device",
    "requires_fp8": "needs FP8 support (compute capability >= 8.9) and TransformerEngine",
    "requires_multi_gpu": "needs at least two CUDA devices",
    "requires_blackwell": "needs a Blackwell GPU (compute capability >= 10.0) and TransformerEngine",
    "slow": "long-running; run with --run-slow or RUN_SLOW=1",
}


@functools.cache
def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.cache
def _compute_capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability() if _cuda_device_count() else (0, 0)


@functools.cache
def _te_importable() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install is as good as none for test selection
        return False
    return True


def _why_unsupported(marker: str, run_slow: bool) -> str | None:
    """Return the reason this machine cannot run tests with ``marker``, or None if it can."""
    gpus = _cuda_device_count()
    if marker == "slow":
        return None if run_slow else "slow test: pass --run-slow or set RUN_SLOW=1"
    if gpus == 0:
        return f"{marker}: no CUDA device on this machine"
    if marker == "requires_multi_gpu" and gpus < 2:
        return f"requires_multi_gpu: {gpus} CUDA device(s), need 2"
    if marker in ("requires_te", "requires_fp8", "requires_blackwell") and not _te_importable():
        return f"{marker}: TransformerEngine is not importable"
    if marker == "requires_fp8" and _compute_capability() < (8, 9):
        return f"requires_fp8: compute capability {_compute_capability()} < (8, 9)"
    if marker == "requires_blackwell" and _compute_capability() < (10, 0):
        return f"requires_blackwell: compute capability {_compute_capability()} < (10, 0)"
    return None


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or os.environ.get("RUN_SLOW") == "1"
    for item in items:
        for marker in MARKERS:
            if item.get_closest_marker(marker) is None:
                continue
            reason = _why_unsupported(marker, run_slow)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break
