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

``--gaps K`` also answers "what is the host doing while the GPU waits": every stretch with no kernel running is
charged to the host operator that launched the kernel ending it (the outermost operator on the launching thread,
e.g. ``Optimizer.step#CompensatedAdamW.step`` or an autograd ``evaluate_function``), and the K longest stretches are
listed with the kernels around them.

``--queue`` answers "is the host ahead of the GPU, and where does it fall behind": every kernel's *lead* is the time
from its launch on the host to its start on the GPU (how long it sat in the queue). Each profiled step
(``ProfilerStep#N``) is cut into ten slices of host time, and the median lead of the kernels launched in each slice
is printed: near zero, the GPU runs each kernel as soon as the host issues it (host-bound); tens of milliseconds, the
host is that far ahead. It also lists the host calls that wait for the GPU (``cudaStreamSynchronize``,
``cudaMemcpy``, ``cudaFree``, ... and any launch or copy call that took over a millisecond): after such a call the
queue is empty and the host's lead starts again from zero.
"""

import argparse
import json
import re
import statistics
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
        ("RoPE", r"rope|rotary|rotate_query_key|rotate_split_grouped_qkv"),  # + the project's kernels (packed_rope.py)
        # + the fused layers' Triton kernels (residual_norm.py: norm_forward, norm_backward)
        (
            "norm (LayerNorm/RMSNorm)",
            r"layer_?norm|rms_?norm|ln_fwd|ln_bwd|norm_fwd|norm_bwd|^norm_forward|^norm_backward",
        ),
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
# Host events that can enclose a kernel launch, and the launches themselves (matched to kernels by "correlation").
HOST_OP_CATEGORIES = {"cpu_op", "user_annotation", "python_function"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
NO_HOST_OP = "(no host operator around the launch)"
# Runtime and driver calls that block the host until the GPU has caught up (or may: a copy from pageable memory).
BLOCKING_CALL = re.compile(
    r"Synchronize|^cudaMemcpy$|^cudaMemcpy2D$|^cudaMemset$|^cudaFree|^cuMemFree|^cudaMalloc|^cudaHostAlloc"
)
SLOW_CALL_US = 1000.0  # any other runtime call this long is listed too (e.g. a launch that found the queue full)


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
    gpu_events = _gpu_events(trace)
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


@dataclass
class IdleGap:
    """A stretch of the profiled window in which no kernel or copy ran on the GPU."""

    start_us: float  # from the first GPU event of the trace
    length_us: float
    kernel_before: str
    kernel_after: str
    host_outer: str  # the outermost host operator around the launch of ``kernel_after``
    host_inner: str  # the innermost one (an aten op, a TE function, ...)


def _gpu_events(trace: dict) -> list[dict]:
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
    return gpu_events


def _host_ops_at(trace_events: list[dict], launches: dict[int, dict]) -> dict[int, tuple[str, str]]:
    """For each launch (by correlation id): the outermost and innermost host operator enclosing it on its thread.

    One sweep per thread over operators sorted by start time, keeping the stack of operators still open; profiler
    step markers (``ProfilerStep#N``) are not operators and are skipped.
    """
    ops_by_thread: dict[tuple, list[tuple[float, float, str]]] = {}
    for event in trace_events:
        if event.get("ph") != "X" or event.get("cat") not in HOST_OP_CATEGORIES:
            continue
        name = event.get("name", "")
        if name.startswith("ProfilerStep#"):
            continue
        start = float(event["ts"])
        ops_by_thread.setdefault((event.get("pid"), event.get("tid")), []).append(
            (start, start + float(event.get("dur", 0)), name)
        )
    queries_by_thread: dict[tuple, list[tuple[float, int]]] = {}
    for correlation, launch in launches.items():
        queries_by_thread.setdefault((launch.get("pid"), launch.get("tid")), []).append(
            (float(launch["ts"]), correlation)
        )

    found: dict[int, tuple[str, str]] = {}
    for thread, queries in queries_by_thread.items():
        # Longer operators first among equal starts, so a parent is pushed before the child it encloses.
        ops = sorted(ops_by_thread.get(thread, []), key=lambda op: (op[0], -op[1]))
        stack: list[tuple[float, float, str]] = []
        next_op = 0
        for time, correlation in sorted(queries):
            while next_op < len(ops) and ops[next_op][0] <= time:
                while stack and stack[-1][1] < ops[next_op][0]:
                    stack.pop()
                stack.append(ops[next_op])
                next_op += 1
            while stack and stack[-1][1] < time:
                stack.pop()
            open_ops = [op for op in stack if op[1] >= time]
            found[correlation] = (open_ops[0][2], open_ops[-1][2]) if open_ops else (NO_HOST_OP, NO_HOST_OP)
    return found


def idle_gaps(trace: dict, min_us: float = 0.0) -> list[IdleGap]:
    """Every stretch of at least ``min_us`` between the first and the last GPU event in which the GPU ran nothing."""
    gpu_events = sorted(_gpu_events(trace), key=lambda e: float(e["ts"]))
    gaps: list[tuple[float, float, dict, dict]] = []
    busy_until, last_event = float("-inf"), None
    for event in gpu_events:
        start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
        if last_event is not None and start - busy_until > max(min_us, 0.0):
            gaps.append((busy_until, start - busy_until, last_event, event))
        if end > busy_until:
            busy_until, last_event = end, event
    launches = {}
    wanted = {e.get("args", {}).get("correlation") for _, _, _, e in gaps}
    for event in trace["traceEvents"]:
        if event.get("cat") in LAUNCH_CATEGORIES:
            correlation = event.get("args", {}).get("correlation")
            if correlation in wanted:
                launches[correlation] = event
    host_ops = _host_ops_at(trace["traceEvents"], launches)
    result = []
    origin = float(gpu_events[0]["ts"])  # gap starts are reported from the first GPU event of the trace
    for start, length, before, after in gaps:
        outer, inner = host_ops.get(after.get("args", {}).get("correlation"), (NO_HOST_OP, NO_HOST_OP))
        result.append(IdleGap(start - origin, length, before.get("name", ""), after.get("name", ""), outer, inner))
    return result


def render_gaps(gaps: list[IdleGap], steps: int, count: int) -> str:
    """Idle time per step by the host operator that ended it, then the ``count`` longest gaps."""
    ms = 1e-3
    idle: dict[str, list[float]] = {}
    for gap in gaps:
        idle.setdefault(gap.host_outer, []).append(gap.length_us)
    total = sum(gap.length_us for gap in gaps)
    lines = [
        f"GPU idle {total / steps * ms:.1f} ms per step in {len(gaps) / steps:.0f} gaps, charged to the host "
        "operator that launched the kernel ending each gap:",
        "",
        "| host operator (outermost) | idle ms/step | gaps/step |",
        "|---|---|---|",
    ]
    for name, lengths in sorted(idle.items(), key=lambda item: -sum(item[1]))[: max(count, 10)]:
        lines.append(f"| {name[:100]} | {sum(lengths) / steps * ms:.2f} | {len(lengths) / steps:.0f} |")
    lines += ["", f"The {count} longest gaps:", ""]
    for gap in sorted(gaps, key=lambda g: -g.length_us)[:count]:
        lines.append(
            f"- {gap.length_us * ms:.2f} ms at +{gap.start_us * ms:.1f} ms: after {gap.kernel_before[:60]}, "
            f"before {gap.kernel_after[:60]}; host in {gap.host_outer[:80]} > {gap.host_inner[:60]}"
        )
    return "\n".join(lines)


@dataclass
class QueueProfile:
    """How far the host runs ahead of the GPU, per tenth of a step, and the host calls that waited for the GPU."""

    steps: int
    # One row per profiled step (ProfilerStep#N, in order): the median launch-to-start delay of the kernels launched
    # in each tenth of the step, and how many were launched there. Steps differ: one that follows a host-device sync
    # (a logging step's read-back, the profiler's start) begins with an empty queue.
    step_names: list[str]
    step_us: list[float]  # each step's length on the host
    lead_us: list[list[float]]
    kernels: list[list[int]]
    blocking: dict[str, tuple[float, int, str]]  # call -> (us per step, calls in the trace, where the longest was)


def queue_profile(trace: dict, steps: int) -> QueueProfile:
    """The host's lead over the GPU through the profiled steps (see ``--queue`` in the module docstring)."""
    events = trace.get("traceEvents", [])
    step_spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e["name"]))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in HOST_OP_CATEGORIES  # not the gpu_user_annotation Kineto writes under the same name
        and str(e.get("name", "")).startswith("ProfilerStep#")
    )
    if not step_spans:
        raise ValueError(
            "the trace has no ProfilerStep#N step markers (the recipes' profiler writes them, as does "
            "torch.profiler's schedule with step())"
        )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    leads: list[list[list[float]]] = [[[] for _ in range(10)] for _ in step_spans]
    for kernel in _gpu_events(trace):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            continue
        launched = float(launch["ts"])
        for index, (start, end, _) in enumerate(step_spans):
            if start <= launched < end:
                tenth = min(int(10 * (launched - start) / (end - start)), 9)
                leads[index][tenth].append(float(kernel["ts"]) - launched)
                break
    waits = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in LAUNCH_CATEGORIES
        and (BLOCKING_CALL.search(str(e.get("name", ""))) or float(e.get("dur", 0)) >= SLOW_CALL_US)
    ]
    host_ops = _host_ops_at(events, dict(enumerate(waits)))
    blocking: dict[str, tuple[float, int, str]] = {}
    for index, event in sorted(enumerate(waits), key=lambda item: -float(item[1].get("dur", 0))):
        total, count, where = blocking.get(event["name"], (0.0, 0, ""))
        outer, inner = host_ops[index]
        blocking[event["name"]] = (total + float(event.get("dur", 0)), count + 1, where or f"{outer} > {inner}")
    return QueueProfile(
        steps=steps,
        step_names=[name for _, _, name in step_spans],
        step_us=[end - start for start, end, _ in step_spans],
        lead_us=[[statistics.median(values) if values else float("nan") for values in step] for step in leads],
        kernels=[[len(values) for values in step] for step in leads],
        blocking={name: (total / steps, count, where) for name, (total, count, where) in blocking.items()},
    )


def render_queue(queue: QueueProfile) -> str:
    ms = 1e-3
    lines = [
        "How far the host is ahead of the GPU: the median launch-to-start delay (ms) of the kernels launched in each "
        "tenth of a step (near 0: the GPU waits for the host), and the kernels launched there:",
        "",
        "| step | ms | " + " | ".join(str(i + 1) for i in range(10)) + " |",
        "|---|---|" + "---|" * 10,
    ]
    for name, length, leads, kernels in zip(queue.step_names, queue.step_us, queue.lead_us, queue.kernels):
        cells = [f"{lead * ms:.2f} ({count})" for lead, count in zip(leads, kernels)]
        lines.append(f"| {name.removeprefix('ProfilerStep#')} | {length * ms:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    if not queue.blocking:
        lines.append("No host call waited for the GPU.")
        return "\n".join(lines)
    lines += [
        "Host calls that waited for the GPU (or took over 1 ms):",
        "",
        "| call | ms/step | calls in the trace | the longest was in |",
        "|---|---|---|---|",
    ]
    for name, (total, count, where) in sorted(queue.blocking.items(), key=lambda item: -item[1][0]):
        lines.append(f"| {name} | {total * ms:.2f} | {count} | {where[:120]} |")
    return "\n".join(lines)


def kernel_origins(trace: dict, steps: int, pattern: str) -> list[tuple[str, str, float, int]]:
    """(outermost host operator, innermost, kernel ms per step, kernels per step) for the kernels whose name matches
    ``pattern``, largest first: which host code launches them."""
    wanted = re.compile(pattern, re.IGNORECASE)
    kernels = [e for e in _gpu_events(trace) if wanted.search(e.get("name", ""))]
    correlations = {e.get("args", {}).get("correlation") for e in kernels}
    launches = {
        e["args"]["correlation"]: e
        for e in trace["traceEvents"]
        if e.get("cat") in LAUNCH_CATEGORIES and e.get("args", {}).get("correlation") in correlations
    }
    host_ops = _host_ops_at(trace["traceEvents"], launches)
    totals: dict[tuple[str, str], list[float]] = {}
    for kernel in kernels:
        where = host_ops.get(kernel.get("args", {}).get("correlation"), (NO_HOST_OP, NO_HOST_OP))
        totals.setdefault(where, []).append(float(kernel["dur"]))
    return sorted(
        ((outer, inner, sum(d) / steps * 1e-3, round(len(d) / steps)) for (outer, inner), d in totals.items()),
        key=lambda row: -row[2],
    )


def render_origins(rows: list[tuple[str, str, float, int]], pattern: str) -> str:
    lines = [f"Kernels matching {pattern!r}, by the host operators that launched them:", ""]
    lines += ["| host operator (outermost) | innermost | ms/step | kernels/step |", "|---|---|---|---|"]
    lines += [f"| {outer[:90]} | {inner[:60]} | {ms:.2f} | {count} |" for outer, inner, ms, count in rows[:15]]
    return "\n".join(lines)


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
    parser.add_argument(
        "--gaps", type=int, default=0, help="also charge the GPU's idle time to host operators and list the K longest"
    )
    parser.add_argument(
        "--queue", action="store_true", help="also show how far the host runs ahead of the GPU, and its waits for it"
    )
    parser.add_argument(
        "--origin", metavar="REGEX", help="also list which host operators launch the kernels whose name matches REGEX"
    )
    args = parser.parse_args(argv)
    if args.origin:
        try:
            re.compile(args.origin)
        except re.error as error:
            parser.error(f"--origin {args.origin!r} is not a regular expression: {error}")
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
    try:
        trace = json.loads(args.trace.read_text())
        print(render(summarise(trace, args.steps), args.title, args.kernels))
        if args.gaps > 0:
            print()
            print(render_gaps(idle_gaps(trace), args.steps, args.gaps))
        if args.queue:
            print()
            print(render_queue(queue_profile(trace, args.steps)))
        if args.origin:
            print()
            print(render_origins(kernel_origins(trace, args.steps, args.origin), args.origin))
    except (ValueError, json.JSONDecodeError) as error:
        print(f"profile_summary: {args.trace}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
