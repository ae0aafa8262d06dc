"""Run a training entrypoint with each process's CUDA memory capped, to see on a larger GPU whether a run fits a
smaller one (an 80 GB H100 on a 141 GB H200). ``ci/benchmark.py --gpu-memory-gib N`` launches its ranks through it:

    python ci/gpu_memory_cap.py GIB ENTRYPOINT [ARGS...]

The cap is ``torch.cuda.set_per_process_memory_fraction`` on the process's device (``LOCAL_RANK``): when PyTorch's
caching allocator would hold more than GIB GiB, the allocation raises ``torch.OutOfMemoryError``, as the smaller card
would. It counts what the allocator holds (tensors, the cache, cuBLAS workspaces), not the CUDA context or memory that
libraries allocate outside PyTorch, so leave the smaller card room for those: an H100 80GB has 79.6 GiB (81,559 MiB
in nvidia-smi), so a cap of 78 GiB stands for it. The entrypoint then runs as ``python ENTRYPOINT ARGS`` would run it (as
``__main__``, with its own folder first on ``sys.path``).
"""

import os
import runpy
import sys
from pathlib import Path


def cap_gpu_memory(gib: float) -> str:
    """Cap this process's allocator on its device at ``gib`` GiB; returns the line that says so."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_memory_cap: error: no CUDA GPU here, nothing to cap (leave --gpu-memory-gib out on CPU)")
    device = int(os.environ.get("LOCAL_RANK", "0"))
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < gib * 2**30 < total:
        raise SystemExit(f"gpu_memory_cap: error: {gib} GiB is not between 0 and this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, device)
    return f"gpu_memory_cap: cuda:{device}'s allocator capped at {gib} GiB of {total / 2**30:.1f} GiB"


def run_entrypoint(entrypoint: str, args: list[str]) -> None:
    """Run ``entrypoint`` as ``python entrypoint *args`` would."""
    path = Path(entrypoint).resolve()
    if not path.is_file():
        raise SystemExit(f"gpu_memory_cap: error: no entrypoint {path}")
    sys.argv = [str(path), *args]
    sys.path[0] = str(path.parent)  # (was this file's folder, ci/)
    runpy.run_path(str(path), run_name="__main__")


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    gib, entrypoint, *args = sys.argv[1:]
    print(cap_gpu_memory(float(gib)), flush=True)
    run_entrypoint(entrypoint, args)


if __name__ == "__main__":
    main()
