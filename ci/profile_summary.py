#!/usr/bin/env python3
"""Summarise a torch.profiler Chrome trace into kernel groups per training step.

The recipes write one trace per rank when ``profiler.enabled=true`` (``<output_dir>/profile_rank0.json``, covering
optimizer steps ``profiler.start_step..end_step``). This script answers "where does a step's time go" in a dozen
lines, the form docs/benchmarks.md records next to a headline number:

    python3 ci/profile_summary.py OUTPUT_DIR/profile_rank0.json --steps 3

It reports, per step: the wall time the profiled window spans, the time at least one GPU kernel (or copy) was
running ("GPU busy"; the rest is the GPU waiting for the host), the number of kernels launched, and the kernel time
of each group (GEMM, attention, RoPE, norms, FP8 quantisation, activations, elementwise, optimizer, communication,
...). Kernel times on different streams can overlap, so the groups may add up to more than "GPU busy".
"""

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path


# First match wins, so the more specific patterns come first (an FP8 "cast_transpose" is quantisation, not a copy;
# TE's "rmsnorm_fwd" is a norm even though its name may carry a cast).
KERNEL_GROUPS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("communication (NCCL)", r"nccl"),
        ("attention", r"fmha|flash|attn|sdpa|fused_attn|cudnn_generated|cudnn::fusion"),  # + cuDNN's bwd helpers
        ("RoPE", r"rope|rotary"),
        ("norm (LayerNorm/RMSNorm)", r"layer_?norm|rms_?norm|ln_fwd|ln_bwd|norm_fwd|norm_bwd"),
        ("FP8 quantise/transpose/amax", r"cast_transpose|quantize|amax|fp8|scale_inv|cast_fp|transpose_dbias"),
        ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul|wgmma"),
        ("activation (GELU/SwiGLU)", r"gelu|swiglu|silu|glu_|dgeglu|dswiglu|relu"),
        ("optimizer", r"multi_tensor|adam|foreach|_amp_"),
        ("cross-entropy", r"cross_entropy|log_softmax|nll_loss|softmax"),
        ("triton (torch.compile)", r"^triton_"),
        ("memcpy/memset", r"memcpy|memset|copy_kernel|catarraybatchedcopy|^Memcpy|^Memset"),
        ("elementwise/reduce (torch)", r"elementwise|reduce_kernel|index|scatter|gather|fill|where|unrolled"),
    )
)
OTHER = "other"
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def kernel_group(name: str) -> str:
    for group, pattern in KERNEL_GROUPS:
        if pattern.search(name):
            return group
    return OTHER


@dataclass
class StepProfile:
    steps: int
    wall_us: float
    busy_us: float
    kernels: int
    group_us: dict[str, float] = field(default_factory=dict)
    group_count: dict[str, int] = field(default_factory=dict)
    # Every kernel name's time per step, by group: the largest are listed for 'other' and with `--kernels K`.
    kernel_us: dict[str, dict[str, float]] = field(default_factory=dict)


def _busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return busy


def summarise(trace: dict, steps: int) -> StepProfile:
    """Group the GPU events of ``trace`` (a loaded Chrome trace) and divide by the number of profiled ``steps``."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if events is None:
        raise ValueError(
            "not a Chrome trace: no 'traceEvents' list (write it with torch.profiler export_chrome_trace)"
        )
    gpu_events = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and float(e.get("dur", 0)) > 0
    ]
    if not gpu_events:
        raise ValueError("the trace holds no GPU kernels: was it recorded on a CUDA device with CUDA activity on?")
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu_events]
    group_us: dict[str, float] = {}
    group_count: dict[str, int] = {}
    kernel_us: dict[str, dict[str, float]] = {}
    for event in gpu_events:
        name = event.get("name", "")
        group = kernel_group(name)
        group_us[group] = group_us.get(group, 0.0) + float(event["dur"])
        group_count[group] = group_count.get(group, 0) + 1
        names = kernel_us.setdefault(group, {})
        names[name] = names.get(name, 0.0) + float(event["dur"])
    wall = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return StepProfile(
        steps=steps,
        wall_us=wall / steps,
        busy_us=_busy_time(intervals) / steps,
        kernels=round(len(gpu_events) / steps),
        group_us={g: t / steps for g, t in group_us.items()},
        group_count={g: round(c / steps) for g, c in group_count.items()},
        kernel_us={g: {n: t / steps for n, t in names.items()} for g, names in kernel_us.items()},
    )


def _largest(profile: StepProfile, group: str, count: int) -> list[tuple[str, float]]:
    return sorted(profile.kernel_us.get(group, {}).items(), key=lambda item: -item[1])[:count]


def render(profile: StepProfile, title: str = "", kernels_per_group: int = 0) -> str:
    ms = 1e-3
    lines = []
    if title:
        lines.append(f"**{title}**")
        lines.append("")
    lines.append(
        f"Per step (mean of {profile.steps} profiled): wall {profile.wall_us * ms:.1f} ms, GPU busy "
        f"{profile.busy_us * ms:.1f} ms ({100 * profile.busy_us / profile.wall_us:.0f}%), "
        f"{profile.kernels:,} kernels and copies."
    )
    lines.append("")
    lines.append("| kernel group | ms/step | share of busy | kernels/step |")
    lines.append("|---|---|---|---|")
    for group, us in sorted(profile.group_us.items(), key=lambda item: -item[1]):
        lines.append(
            f"| {group} | {us * ms:.1f} | {100 * us / profile.busy_us:.0f}% | {profile.group_count[group]:,} |"
        )
    top_other = _largest(profile, OTHER, 5)
    if top_other:
        lines.append("")
        lines.append("Largest kernels in 'other': " + "; ".join(f"{n[:80]} {t * ms:.1f} ms" for n, t in top_other))
    if kernels_per_group > 0:
        lines.append("")
        for group, _group_us in sorted(profile.group_us.items(), key=lambda item: -item[1]):
            largest = _largest(profile, group, kernels_per_group)
            lines.append(f"- {group}: " + "; ".join(f"{n[:100]} {t * ms:.2f} ms" for n, t in largest))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a torch.profiler Chrome trace (profile_rank0.json)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in the trace (end - start + 1)")
    parser.add_argument("--title", default="", help="a heading for the table")
    parser.add_argument("--kernels", type=int, default=0, help="also list the K largest kernels of every group")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
    try:
        trace = json.loads(args.trace.read_text())
        print(render(summarise(trace, args.steps), args.title, args.kernels))
    except (ValueError, json.JSONDecodeError) as error:
        print(f"profile_summary: {args.trace}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
