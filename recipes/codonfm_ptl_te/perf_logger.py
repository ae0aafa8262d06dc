# Copied from common/perf_logger.py — edit the source, then run ci/check_copies.py --fix
"""Training metrics: progress, loss/throughput/MFU logging (also to Weights & Biases: wandb_run.py), summary.json,
profiler window.

The hot loop must not wait for the GPU, so per-step values (loss, token counts, attention work) are accumulated as
device tensors. A logging step (every ``log_every`` steps) is collective: all ranks reduce their counters together.
It does not wait for the GPU either: the window's sums are copied to pinned host memory behind the work already
queued, a CUDA event marks the window's end on the GPU's timeline, and the window is reported (rank 0 prints and
writes) at the first later step whose host finds the copy landed, usually the next one; ``finish`` reports the rest.
Reading the sums back at once would make the host wait for the GPU to finish everything it had queued, and the next
step would start with an empty queue: where the forward pass is host-bound (FP8 on one GPU), the GPU then idles for
the host's whole forward deficit, once per logging step (ESM-2 3B in FP8, logging every 5 steps: 0.9-1.4% slower
than every 15, docs/benchmarks.md). Window times come from the CUDA events (on the GPU's timeline), or from the host
clock without CUDA.

Throughput counts *unpadded* tokens (BSHD: ``attention_mask.sum()``; THD: tokens that are not ``<pad>``, so a
packed batch's padding pseudo-sequence does not count) summed over ranks and divided by the world size.

Progress goes to a terminal as a tqdm bar. Off a terminal (a log file, SLURM, ``docker run`` without ``-t``) a bar
is one endless line of carriage returns, so there rank 0 logs one plain line per logging step instead (step, loss,
gradient norm, tokens/s, MFU, ETA), and the bars of transformers, huggingface_hub and datasets (loading weights,
preparing data, writing the export) are off: :func:`quiet_progress_bars_off_a_terminal`, first thing in a run.
"""

import cProfile
import json
import logging
import math
import pstats
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from huggingface_hub.utils import disable_progress_bars as disable_hub_progress_bars
from tqdm.auto import tqdm
from user_errors import ConfigError
from wandb_run import start_wandb_run


logger = logging.getLogger(__name__)

H100_BF16_DENSE_PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16 tensor-core peak


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs of an encoder, counted the way MFU is usually reported (no recomputation).

    For ``T`` real tokens in sequences of lengths ``L_i``::

        flops = 6 * N * T + 12 * n_layers * hidden * sum_i(L_i ** 2)

    ``N`` is the number of non-embedding parameters: each costs a multiply-add (2 FLOPs) per token forward and twice
    that backward. The attention term covers ``Q @ K^T`` and ``softmax @ V`` (2 * L * hidden FLOPs per token and layer
    each, forward), times 3 for forward + backward. Per token this is the familiar
    ``6 * N + 12 * n_layers * hidden * seq_len`` with ``seq_len = sum(L_i ** 2) / sum(L_i)``, the length each token
    actually attends over, so packed short sequences are not credited with work they did not need.
    """

    non_embedding_params: int
    num_layers: int
    hidden_size: int

    def flops(self, tokens: float, sum_squared_lengths: float) -> float:
        return 6 * self.non_embedding_params * tokens + 12 * self.num_layers * self.hidden_size * sum_squared_lengths

    @classmethod
    def from_model(cls, model: torch.nn.Module, num_layers: int, hidden_size: int) -> "ModelFlops":
        """Count parameters outside ``nn.Embedding`` modules (tied LM-head weights are the embedding, so excluded).

        Works on meta-device and sharded models alike: a DTensor's ``numel`` is its global size.
        """
        embedding_ids = {
            id(p) for module in model.modules() if isinstance(module, torch.nn.Embedding) for p in module.parameters()
        }
        params = {id(p): p for p in model.parameters()}  # unique: tied weights once
        non_embedding = sum(p.numel() for key, p in params.items() if key not in embedding_ids)
        return cls(non_embedding, num_layers, hidden_size)


def batch_token_stats(batch: dict[str, Any], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(unpadded tokens, sum of squared sequence lengths) of one micro-batch, as tensors on the batch's device."""
    input_ids = batch["input_ids"]
    if "cu_seq_lens_q" in batch:  # THD: count non-pad tokens; lengths from the (padded) sequence boundaries
        tokens = (input_ids != pad_token_id).sum()
        cu = batch.get("cu_seq_lens_q_padded", batch["cu_seq_lens_q"])
        lengths = (cu[1:] - cu[:-1]).to(device=input_ids.device, dtype=torch.float64)
    else:
        mask = batch.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask
        tokens = mask.sum()
        lengths = mask.sum(dim=-1).to(torch.float64)
    return tokens.to(torch.float64), (lengths**2).sum()


class _HostClock:
    """Window boundaries on the host's clock (no CUDA): a mark is a ``perf_counter`` reading, ready at once."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class _CudaClock:
    """Window boundaries on the GPU's timeline: a mark is a CUDA event recorded behind the work queued so far, ready
    once the GPU has run everything before it. Recording and querying never wait for the GPU."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000


@dataclass
class _ClosedWindow:
    """A logging window whose sums are on their way to the host."""

    step: int
    window_start_step: int
    steps: int
    lr: float
    sums: torch.Tensor  # [loss sum, tokens, sum L^2, grad norm] in (pinned) host memory once ``end`` is ready
    start: Any  # clock marks
    end: Any


class PerfLogger:
    """Logs every ``log_every`` steps and writes ``metrics.jsonl`` during and ``summary.json`` after training.

    Args:
        cfg: the full run config (``logger``, ``wandb``, ``output_dir``, ``num_train_steps`` are read).
        model_flops: see :class:`ModelFlops`.
        pad_token_id: what THD padding looks like.
        start_step: the step a resumed run starts after (0 for a fresh run).
        cp_size: context-parallel ranks share each sequence, so their attention work is counted once.
        config_name: recorded in the summary.
    """

    def __init__(
        self,
        cfg,
        model_flops: ModelFlops,
        pad_token_id: int,
        start_step: int = 0,
        cp_size: int = 1,
        config_name: str = "",
    ):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.log_every = int(cfg.logger.log_every)
        self.warmup_steps = int(cfg.logger.warmup_steps)
        self.peak_flops = float(cfg.logger.peak_flops_per_gpu)
        self.model_flops, self.pad_token_id, self.cp_size = model_flops, pad_token_id, cp_size
        self.config_name = config_name
        self.output_dir = Path(cfg.output_dir)
        self.total_steps = int(cfg.num_train_steps)

        self._counters: torch.Tensor | None = None  # [loss sum, tokens, sum L^2] over the current window
        self._window_steps, self._window_start_step = 0, start_step
        self._clock = _CudaClock() if torch.cuda.is_available() else _HostClock()
        self._window_start = self._clock.mark()
        self._closed: list[_ClosedWindow] = []  # closed windows not reported yet, oldest first
        self.history: list[dict[str, float]] = []

        self._start_step, self._start_time = start_step, time.perf_counter()
        self._progress = None  # the tqdm bar on a terminal; None off one (and on ranks > 0)
        self._wandb = None
        if self.rank == 0:
            self._wandb = start_wandb_run(cfg, resuming=start_step > 0)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            metrics_path = self.output_dir / "metrics.jsonl"
            if start_step > 0:
                drop_metrics_after(metrics_path, start_step)
            self._metrics_file = metrics_path.open("a")
            if sys.stderr.isatty():
                self._progress = tqdm(total=self.total_steps, initial=start_step, desc="train", dynamic_ncols=True)
            else:
                quiet_progress_bars_off_a_terminal()

    # ------------------------------------------------------------------ hot loop: no host-device sync here

    def count_batch(self, batch: dict[str, Any]) -> None:
        """Add one micro-batch's token counts; call it for every micro-batch once the batch is on its device."""
        tokens, squared = batch_token_stats(batch, self.pad_token_id)
        counters = self._window_counters(tokens.device)
        counters[1] += tokens
        counters[2] += squared / self.cp_size

    def log_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float | None, lr: float) -> None:
        """Record optimizer step ``step`` (1-based); every ``log_every`` steps reduce, print and write."""
        self._window_counters(loss.device)[0] += loss.detach().to(torch.float64)
        self._window_steps += 1
        if self._progress is not None:
            self._progress.update(1)
        if step % self.log_every == 0 or step == self.total_steps:
            self._close_window(step, grad_norm, lr)
        self._report_closed_windows(wait=False)

    def _window_counters(self, device: torch.device) -> torch.Tensor:
        if self._counters is None:
            self._counters = torch.zeros(3, dtype=torch.float64, device=device)
        return self._counters

    # ------------------------------------------------------------------ logging steps

    def _close_window(self, step: int, grad_norm: torch.Tensor | float | None, lr: float) -> None:
        """Reduce the window's sums over the ranks and start copying them to the host, without waiting for either."""
        counters = self._counters
        if dist.is_initialized():
            dist.all_reduce(counters)  # one collective for all three sums
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()  # sharded models report a DTensor norm
        if grad_norm is None or not torch.is_tensor(grad_norm) or grad_norm.device != counters.device:
            # No norm, or one on the host (a trainer's float): a fill on the device, not a copy that would wait.
            value = float("nan") if grad_norm is None else float(grad_norm)
            grad_norm = torch.full((1,), value, dtype=torch.float64, device=counters.device)
        sums = torch.cat([counters, grad_norm.detach().reshape(1).to(torch.float64)])
        if sums.is_cuda:  # into pinned memory, behind the window's work: the end mark below is ready once it landed
            sums = sums.to("cpu", non_blocking=True)
        end = self._clock.mark()
        self._closed.append(
            _ClosedWindow(step, self._window_start_step, self._window_steps, lr, sums, self._window_start, end)
        )
        counters.zero_()  # runs after the copy on the same stream
        self._window_steps, self._window_start_step = 0, step
        self._window_start = end

    def _report_closed_windows(self, wait: bool) -> None:
        """Report the closed windows whose sums have reached the host, oldest first (all of them with ``wait``)."""
        while self._closed and (wait or self._clock.ready(self._closed[0].end)):
            window = self._closed.pop(0)
            if wait:
                self._clock.wait(window.end)
            self._report(window)

    def _report(self, window: _ClosedWindow) -> None:
        loss_sum, tokens, squared, grad_norm = window.sums.tolist()
        elapsed = self._clock.seconds(window.start, window.end)
        loss = loss_sum / (window.steps * self.world_size)
        tokens_per_gpu_s = tokens / self.world_size / elapsed
        flops_per_gpu_s = self.model_flops.flops(tokens, squared) / self.world_size / elapsed
        metrics = {
            "step": window.step,
            "loss": loss,
            "perplexity": math.exp(min(loss, 50.0)),
            "grad_norm": grad_norm,
            "lr": window.lr,
            "step_time_s": elapsed / window.steps,
            "tokens_per_second_per_gpu": tokens_per_gpu_s,
            "mfu": flops_per_gpu_s / self.peak_flops,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
            "window_start_step": window.window_start_step,
        }
        self.history.append(metrics)
        if self.rank == 0:
            self._metrics_file.write(json.dumps(metrics) + "\n")
            self._metrics_file.flush()
            if self._progress is not None:
                self._progress.set_postfix(
                    loss=f"{loss:.4f}", gnorm=f"{grad_norm:.3f}", tok_s=f"{tokens_per_gpu_s:.3g}"
                )
            else:
                logger.info(self._progress_line(metrics))
            if self._wandb is not None:
                self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=window.step)

    def _progress_line(self, metrics: dict[str, float]) -> str:
        """``step 40/150 | loss 3.2154 | grad_norm 2.505 | 1.95e+03 tokens/s/gpu | mfu 0.1% | eta 1m12s``."""
        step = int(metrics["step"])
        seconds_per_step = (time.perf_counter() - self._start_time) / max(step - self._start_step, 1)
        return (
            f"step {step}/{self.total_steps} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f} | "
            f"{metrics['tokens_per_second_per_gpu']:.3g} tokens/s/gpu | mfu {100 * metrics['mfu']:.1f}% | "
            f"eta {format_duration(seconds_per_step * (self.total_steps - step))}"
        )

    def finish(self) -> dict[str, Any] | None:
        """Report the windows still in flight, close the bar and W&B run; on rank 0 write and return ``summary.json``."""
        self._report_closed_windows(wait=True)
        if self.rank != 0:
            return None
        if self._progress is not None:
            self._progress.close()
        self._metrics_file.close()
        summary_path = self.output_dir / "summary.json"
        if not self.history and summary_path.exists():
            # A relaunch of a finished run (say, after a kill during the export) trains nothing: keep its summary.
            logger.info("No step logged in this launch; %s is kept as it was", summary_path)
            return json.loads(summary_path.read_text())
        # Windows that start after warm-up (compilation, allocator growth, first NCCL calls) measure steady state.
        steady = [m for m in self.history if m["window_start_step"] >= self.warmup_steps] or self.history
        summary = {
            "config_name": self.config_name,
            "world_size": self.world_size,
            "steps": self.history[-1]["step"] if self.history else 0,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "median_tokens_per_second_per_gpu": _median(m["tokens_per_second_per_gpu"] for m in steady),
            "median_mfu": _median(m["mfu"] for m in steady),
            "median_step_time_s": _median(m["step_time_s"] for m in steady),
            "peak_memory_gb": max((m["peak_memory_gb"] for m in self.history), default=0.0),
            "logged_windows_in_medians": len(steady),
            "perf_warmup_steps": self.warmup_steps,
            "peak_flops_per_gpu": self.peak_flops,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        }
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        if self._wandb is not None:
            self._wandb.summary.update(summary)
            self._wandb.finish()
        return summary


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def quiet_progress_bars_off_a_terminal() -> None:
    """Off a terminal, turn off the libraries' progress bars: each would be one long line of carriage returns in a
    log. Call it first in an entrypoint, before anything loads weights or prepares data."""
    if sys.stderr.isatty():
        return
    transformers.utils.logging.disable_progress_bar()
    disable_hub_progress_bars()
    datasets = sys.modules.get("datasets")  # only a recipe that reads data with it has imported it
    if datasets is not None:
        datasets.disable_progress_bars()


def drop_metrics_after(path: Path, step: int) -> None:
    """Keep the lines of ``metrics.jsonl`` up to ``step``, the checkpoint a run resumes from.

    The steps after it were logged by a run that died before its next checkpoint; they are about to be trained (and
    logged) again. A line torn by a kill mid-write goes too. So the file holds one line per logged step.
    """
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    if kept != lines:
        staging = path.with_name(path.name + ".tmp")
        staging.write_text("".join(line + "\n" for line in kept))
        staging.replace(path)
        logger.info(
            "%s: dropped %d line(s) after step %d, which this run trains again", path, len(lines) - len(kept), step
        )


def format_duration(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``: an ETA at the precision that matters."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Profiler:
    """Profile steps ``start_step..end_step`` (inclusive) with torch.profiler, as an Nsight Systems capture range, or
    with Python's cProfile.

    ``kind: torch`` writes a Chrome trace per rank to ``<output_dir>/profile_rank<r>.json``. ``kind: nsys`` calls
    ``cudaProfilerStart/Stop`` around the window and marks each step with an NVTX range; run under
    ``nsys profile --capture-range=cudaProfilerApi``. ``kind: python`` profiles the host's Python (where a
    host-bound step spends its time: module calls, hooks, kernel launches) and writes
    ``<output_dir>/host_profile_rank<r>.txt`` (the top functions by own and by cumulative time) and
    ``host_profile_rank<r>.pstats`` (for ``python -m pstats`` or snakeviz). On Python 3.12 and later it sees every
    thread, autograd's backward thread included; before, only the training loop's. Its per-call overhead inflates
    short Python functions: compare functions, not the step time.
    """

    def __init__(self, cfg, output_dir: str | Path):
        self.enabled = bool(cfg.enabled)
        self.kind, self.start_step, self.end_step = cfg.kind, int(cfg.start_step), int(cfg.end_step)
        if self.enabled and self.kind not in ("torch", "nsys", "python"):
            raise ConfigError(f"profiler.kind={self.kind}: choose torch, nsys or python")
        if self.enabled and self.end_step < self.start_step:
            raise ConfigError(
                f"profiler.end_step={self.end_step} comes before profiler.start_step={self.start_step}: "
                "set end_step >= start_step"
            )
        self.output_dir = Path(output_dir)
        self._torch_profiler = None
        self._host_profiler = None

    def step_context(self, step: int):
        """Wrap optimizer step ``step`` (1-based): starts the window on its first step, stops after its last."""
        if not self.enabled or not self.start_step <= step <= self.end_step:
            return nullcontext()
        return _ProfiledStep(self, step)

    def _start(self) -> None:
        if self.kind == "nsys":
            torch.cuda.profiler.start()
            return
        if self.kind == "python":
            self._host_profiler = cProfile.Profile()
            self._host_profiler.enable()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._torch_profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._torch_profiler.__enter__()

    def _stop(self) -> None:
        if self.kind == "nsys":
            torch.cuda.profiler.stop()
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.kind == "python":
            self._host_profiler.disable()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._host_profiler.dump_stats(self.output_dir / f"host_profile_rank{rank}.pstats")
            report = self.output_dir / f"host_profile_rank{rank}.txt"
            with report.open("w") as out:
                for order in ("tottime", "cumulative"):
                    out.write(f"# steps {self.start_step}-{self.end_step}, sorted by {order}\n")
                    pstats.Stats(self._host_profiler, stream=out).sort_stats(order).print_stats(60)
            logger.info("Wrote host profile %s", report)
            self._host_profiler = None
            return
        self._torch_profiler.__exit__(None, None, None)
        trace = self.output_dir / f"profile_rank{rank}.json"
        self._torch_profiler.export_chrome_trace(str(trace))
        logger.info("Wrote profiler trace %s", trace)
        self._torch_profiler = None


class _ProfiledStep:
    def __init__(self, profiler: Profiler, step: int):
        self.profiler, self.step = profiler, step
        self._marker = None

    def __enter__(self):
        if self.step == self.profiler.start_step:
            self.profiler._start()
        if self.profiler.kind == "nsys":
            torch.cuda.nvtx.range_push(f"step {self.step}")
        elif self.profiler.kind == "torch":
            # The marker torch.profiler's own schedule writes: ci/profile_summary.py --queue cuts the trace by it.
            self._marker = torch.profiler.record_function(f"ProfilerStep#{self.step}")
            self._marker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.profiler.kind == "nsys":
            torch.cuda.nvtx.range_pop()
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
        if self.step == self.profiler.end_step:
            self.profiler._stop()
        return False
