import json
import math
import pstats
import sys

import pytest
import torch
from omegaconf import OmegaConf
from perf_logger import ModelFlops, PerfLogger, Profiler, batch_token_stats, drop_metrics_after, format_duration


PAD = 1


def test_bshd_counts_attention_mask():
    batch = {
        "input_ids": torch.tensor([[0, 5, 6, 2, PAD], [0, 7, 2, PAD, PAD]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
    }
    tokens, squared = batch_token_stats(batch, PAD)
    assert tokens.item() == 7
    assert squared.item() == 4**2 + 3**2


def test_thd_excludes_the_padding_pseudo_sequence():
    # Two sequences (4 and 3 tokens) packed, then a 3-token pad pseudo-sequence to reach a multiple of 10.
    batch = {
        "input_ids": torch.tensor([[0, 5, 6, 2, 0, 7, 2, PAD, PAD, PAD]]),
        "cu_seq_lens_q": torch.tensor([0, 4, 7, 10], dtype=torch.int32),
    }
    tokens, squared = batch_token_stats(batch, PAD)
    assert tokens.item() == 7
    assert squared.item() == 4**2 + 3**2 + 3**2  # the pseudo-sequence's own attention is tiny and counted


def test_flops_formula_by_hand():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))  # 40 embedding, 20 other params
    flops = ModelFlops.from_model(model, num_layers=2, hidden_size=4)
    assert flops.non_embedding_params == 20
    # 6 * 20 params * 100 tokens + 12 * 2 layers * 4 hidden * 500 (sum of squared lengths)
    assert flops.flops(tokens=100, sum_squared_lengths=500) == 12000 + 48000


def test_tied_embedding_counts_once():
    embedding, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    flops = ModelFlops.from_model(torch.nn.ModuleList([embedding, head]), num_layers=1, hidden_size=4)
    assert flops.non_embedding_params == 0


def _cfg(tmp_path, log_every=2):
    return OmegaConf.create(
        {
            "output_dir": str(tmp_path),
            "num_train_steps": 6,
            "logger": {"log_every": log_every, "warmup_steps": 2, "peak_flops_per_gpu": 1e12},
            "wandb": {"mode": "disabled", "project": "p", "name": "n"},
        }
    )


def test_logs_every_n_steps_and_writes_summary(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # disabled W&B must not even import it
    flops = ModelFlops(non_embedding_params=1000, num_layers=1, hidden_size=8)
    perf = PerfLogger(_cfg(tmp_path), flops, pad_token_id=PAD, config_name="unit")
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    for step in range(1, 7):
        perf.count_batch(batch)
        perf.log_step(step, torch.tensor(float(step)), torch.tensor(0.5), lr=0.1)
    summary = perf.finish()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 4, 6]
    assert [m["loss"] for m in lines] == [1.5, 3.5, 5.5]  # mean over each 2-step window
    assert lines[0]["grad_norm"] == 0.5 and lines[0]["lr"] == 0.1
    window = lines[-1]  # 2 steps x 6 tokens, sequences of length 3
    assert window["tokens_per_second_per_gpu"] == pytest.approx(12 / (2 * window["step_time_s"]))
    expected_flops = 6 * 1000 * 12 + 12 * 1 * 8 * (4 * 3**2)
    assert window["mfu"] == pytest.approx(expected_flops / (2 * window["step_time_s"]) / 1e12)

    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["steps"] == 6 and summary["final_loss"] == 5.5 and summary["world_size"] == 1
    assert summary["config_name"] == "unit"
    assert summary["logged_windows_in_medians"] == 2  # the window starting at step 0 is warm-up
    assert summary["median_tokens_per_second_per_gpu"] > 0


class _ManualClock:
    """A stand-in for the CUDA-event clock: a mark is ready only once the test (or a wait) lets the GPU reach it."""

    def __init__(self):
        self.marks, self.reached, self.waited = 0, 0, []

    def mark(self):
        self.marks += 1
        return self.marks

    def ready(self, mark):
        return mark <= self.reached

    def wait(self, mark):
        self.waited.append(mark)
        self.reached = max(self.reached, mark)

    def seconds(self, start, end):
        return 2.0 * (end - start)  # two seconds between consecutive marks


def test_a_window_is_reported_once_its_sums_reach_the_host_without_waiting_for_them(tmp_path):
    perf = PerfLogger(_cfg(tmp_path), ModelFlops(1000, 1, 8), pad_token_id=PAD)
    clock = perf._clock = _ManualClock()
    perf._window_start = clock.mark()  # mark 1: the first window's start
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    logged = []

    def step(n, grad_norm=0.5):
        if grad_norm is not None and n != 6:  # step 6 passes a plain float, as some trainers report the norm
            grad_norm = torch.tensor(grad_norm)
        perf.count_batch(batch)
        perf.log_step(n, torch.tensor(float(n)), grad_norm, lr=0.1)
        logged.append([m["step"] for m in perf.history])

    step(1)
    step(2)  # closes the window (end mark 2); the GPU has not reached it: nothing reported, nothing waited for
    assert logged[-1] == [] and clock.waited == []
    clock.reached = 2  # the copy has landed
    step(3)
    assert logged[-1] == [2]
    step(4, grad_norm=None)  # closes window 2 (mark 3), not reached yet
    step(5)
    step(6)  # closes window 3 (mark 4), the last step
    assert logged[-1] == [2] and clock.waited == []
    summary = perf.finish()  # waits for the windows still in flight, in order
    assert clock.waited == [3, 4]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 4, 6]
    assert [m["loss"] for m in lines] == [1.5, 3.5, 5.5]
    assert math.isnan(lines[1]["grad_norm"]) and lines[2]["grad_norm"] == 0.5
    assert [m["step_time_s"] for m in lines] == [1.0, 1.0, 1.0]  # 2 s per window on the clock, 2 steps each
    assert lines[0]["tokens_per_second_per_gpu"] == 12 / 2.0
    assert summary["steps"] == 6 and summary["logged_windows_in_medians"] == 2


def _run_six_steps(tmp_path, start_step=0):
    perf = PerfLogger(_cfg(tmp_path), ModelFlops(1000, 1, 8), pad_token_id=PAD, start_step=start_step)
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    for step in range(start_step + 1, 7):
        perf.count_batch(batch)
        perf.log_step(step, torch.tensor(float(step)), torch.tensor(0.5), lr=0.1)
    perf.finish()


def test_off_a_terminal_progress_is_one_plain_line_per_logging_step(tmp_path, caplog, capsys):
    """stderr is not a TTY under pytest, as in a log file or a SLURM job: no bar, no carriage returns."""
    with caplog.at_level("INFO", logger="perf_logger"):
        _run_six_steps(tmp_path, start_step=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "perf_logger"]
    assert [line.split(" | ")[0] for line in lines] == ["step 4/6", "step 6/6"]
    assert lines[0].startswith("step 4/6 | loss 3.5000 | grad_norm 0.500 | ")
    assert "tokens/s/gpu | mfu " in lines[0] and lines[-1].endswith("| eta 0s")
    captured = capsys.readouterr()
    assert "\r" not in captured.err + captured.out and "it/s" not in captured.err


def test_on_a_terminal_progress_is_a_bar(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with caplog.at_level("INFO", logger="perf_logger"):
        _run_six_steps(tmp_path)
    assert not [r for r in caplog.records if r.name == "perf_logger" and r.getMessage().startswith("step ")]


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (44.6, "45s"), (192, "3m12s"), (7500, "2h05m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_a_resume_drops_the_lines_it_trains_again_and_a_torn_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in (2, 4, 6)) + '{"step": 8, "lo'
    )
    drop_metrics_after(metrics, 4)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [2, 4]
    _run_six_steps(tmp_path, start_step=4)  # the resumed run logs step 6 once more
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [2, 4, 6]


def test_a_fresh_run_appends_to_an_existing_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 6, "loss": 1.0}) + "\n")
    _run_six_steps(tmp_path)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [6, 2, 4, 6]


def test_a_launch_that_trains_nothing_keeps_the_summary(tmp_path):
    """Relaunching a finished run (e.g. after a kill during the export) must not overwrite its summary with nothing."""
    _run_six_steps(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6
    _run_six_steps(tmp_path, start_step=6)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_wandb_enabled_without_package_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = _cfg(tmp_path)
    cfg.wandb.mode = "offline"
    with pytest.raises(ImportError, match="wandb.mode=offline needs the wandb package"):
        PerfLogger(cfg, ModelFlops(1, 1, 1), pad_token_id=PAD)


def test_torch_profiler_traces_only_its_window(tmp_path):
    cfg = OmegaConf.create({"enabled": True, "kind": "torch", "start_step": 2, "end_step": 3})
    profiler = Profiler(cfg, tmp_path)
    for step in range(1, 5):
        with profiler.step_context(step):
            torch.ones(8, 8) @ torch.ones(8, 8)
        active = profiler._torch_profiler is not None
        assert active == (step == 2), step  # running after step 2, stopped and written after step 3
    trace = json.loads((tmp_path / "profile_rank0.json").read_text())
    markers = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    assert markers == ["ProfilerStep#2", "ProfilerStep#3"]  # what ci/profile_summary.py --queue cuts steps by


def _host_work():
    return sum(i * i for i in range(2000))


def test_python_profiler_profiles_only_its_window(tmp_path):
    cfg = OmegaConf.create({"enabled": True, "kind": "python", "start_step": 2, "end_step": 3})
    profiler = Profiler(cfg, tmp_path / "out")
    for step in range(1, 5):
        with profiler.step_context(step):
            _host_work()
        assert (profiler._host_profiler is not None) == (step == 2), step
    stats = pstats.Stats(str(tmp_path / "out" / "host_profile_rank0.pstats"))
    calls = {func[2]: stat[1] for func, stat in stats.stats.items()}  # function name -> primitive calls
    assert calls["_host_work"] == 2  # steps 2 and 3, not 1 or 4
    report = (tmp_path / "out" / "host_profile_rank0.txt").read_text()
    assert "sorted by tottime" in report and "sorted by cumulative" in report and "_host_work" in report


def test_profiler_kind_is_validated(tmp_path):
    with pytest.raises(ValueError, match="profiler.kind=perf: choose torch, nsys or python"):
        Profiler(OmegaConf.create({"enabled": True, "kind": "perf", "start_step": 1, "end_step": 1}), tmp_path)


def test_profiler_window_is_validated(tmp_path):
    with pytest.raises(ValueError, match="profiler.end_step=1 comes before profiler.start_step=2"):
        Profiler(OmegaConf.create({"enabled": True, "kind": "torch", "start_step": 2, "end_step": 1}), tmp_path)


@pytest.mark.requires_gpu
def test_logging_steps_do_not_wait_for_the_gpu(tmp_path):
    """With CUDA tensors, no call of the hot loop, logging steps included, may synchronise with the GPU: torch
    raises on any that does while the sync debug mode is "error". The windows arrive all the same."""
    perf = PerfLogger(_cfg(tmp_path), ModelFlops(1000, 1, 8), pad_token_id=PAD)
    batch = {
        "input_ids": torch.full((1, 6), 5, dtype=torch.long, device="cuda"),  # no padding: 6 tokens
        "cu_seq_lens_q": torch.tensor([0, 3, 6], dtype=torch.int32, device="cuda"),
    }
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 7):
            for _ in range(20):  # keep the GPU busy so that a sync would have something to wait for
                busy = torch.tanh(busy @ busy)
            perf.count_batch(batch)
            grad_norm = torch.full((), 0.5, device="cuda") if step % 4 else None
            perf.log_step(step, torch.full((), float(step), device="cuda"), grad_norm, lr=0.1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    perf.finish()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 4, 6]
    assert [m["loss"] for m in lines] == [1.5, 3.5, 5.5]
    assert lines[0]["grad_norm"] == 0.5 and math.isnan(lines[1]["grad_norm"])
    for m in lines:  # 2 steps of 6 tokens per window, timed by CUDA events
        assert m["step_time_s"] > 0
        assert m["tokens_per_second_per_gpu"] == pytest.approx(12 / (2 * m["step_time_s"]))
