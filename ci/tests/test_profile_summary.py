"""ci/profile_summary.py: kernel grouping, GPU-busy time and per-step averages on hand-written traces."""

import json
import math
import sys
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "ci"))
import profile_summary  # noqa: E402


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


# Two steps of 100 us each; kernels overlap on two streams in step 1 and the GPU idles 40 us in step 2.
TRACE = {
    "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host events are ignored
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0, 50),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 40, 30),  # overlaps the GEMM by 10 us
        kernel("void transformer_engine::fused_rope_forward_kernel<float>", 70, 10),
        kernel("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel", 80, 20),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 100, 20),
        kernel("Memcpy HtoD (Pageable -> Device)", 120, 5, cat="gpu_memcpy"),
        kernel("void transformer_engine::cast_transpose_kernel<fp8e4m3>", 125, 15),
        kernel("void multi_tensor_apply_kernel<AdamFunctor>", 180, 20),
        kernel("my_custom_kernel", 140, 0),  # zero length: not counted
    ]
}


def test_groups_busy_time_and_per_step_means():
    profile = profile_summary.summarise(TRACE, steps=2)
    assert profile.wall_us == pytest.approx(100.0)  # 0..200 us over 2 steps
    assert profile.busy_us == pytest.approx((100 + 40 + 20) / 2)  # 0-100 (union), 100-140, 180-200
    assert profile.kernels == 4  # 8 kernels and copies with a duration, over 2 steps
    assert profile.group_us == pytest.approx(
        {
            "GEMM": 25.0,
            "attention": 15.0,
            "RoPE": 5.0,
            "norm (LayerNorm/RMSNorm)": 10.0,
            "communication (NCCL)": 10.0,
            "memcpy/memset": 2.5,
            "FP8 quantise/transpose/amax": 7.5,
            "optimizer": 10.0,
        }
    )


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("void transformer_engine::normalization::ln_bwd_tuned_kernel", "norm (LayerNorm/RMSNorm)"),
        ("void transformer_engine::fused_rope_backward_kernel", "RoPE"),
        ("rotate_split_grouped_qkv", "RoPE"),
        ("rotate_query_key", "RoPE"),
        ("norm_backward", "norm (LayerNorm/RMSNorm)"),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "GEMM"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "GEMM"),
        ("void transformer_engine::dswiglu_kernel", "activation (GELU/SwiGLU)"),
        ("triton_poi_fused_add_mul_tanh_0", "triton (torch.compile)"),
        (
            "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>",
            "elementwise/reduce (torch)",
        ),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward", "cross-entropy"),
        ("void cudnn::fusion::compute_dot_do_o_ragged_specialized<true, 64>", "attention"),
        ("something_new", "other"),
    ],
)
def test_kernel_names_land_in_their_group(name, group):
    assert profile_summary.kernel_group(name) == group


def test_render_lists_groups_largest_first_and_names_other_kernels():
    trace = {"traceEvents": [kernel("gemm_a", 0, 30), kernel("mystery_kernel", 30, 10)]}
    text = profile_summary.render(profile_summary.summarise(trace, steps=1), title="t")
    lines = text.splitlines()
    assert lines[0] == "**t**"
    assert "wall 0.0 ms, GPU busy 0.0 ms (100%), 2 kernels" in text
    assert lines.index("| GEMM | 0.0 | 75% | 1 |") < lines.index("| other | 0.0 | 25% | 1 |")
    assert "Largest kernels in 'other': mystery_kernel" in text


def test_command_line_and_clear_errors(tmp_path, capsys):
    good = tmp_path / "profile_rank0.json"
    good.write_text(json.dumps(TRACE))
    assert profile_summary.main([str(good), "--steps", "2"]) == 0
    assert "| GEMM | 0.0 |" in capsys.readouterr().out

    no_gpu = tmp_path / "cpu_only.json"
    no_gpu.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]})
    )
    assert profile_summary.main([str(no_gpu), "--steps", "1"]) == 2
    assert "no GPU kernels" in capsys.readouterr().err

    not_a_trace = tmp_path / "list.json"
    not_a_trace.write_text("[]")
    assert profile_summary.main([str(not_a_trace), "--steps", "1"]) == 2
    assert "no 'traceEvents'" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        profile_summary.main([str(tmp_path / "missing.json"), "--steps", "1"])
    with pytest.raises(ValueError, match="at least 1"):
        profile_summary.summarise(TRACE, steps=0)


def test_largest_kernels_of_each_group_on_request():
    trace = {"traceEvents": [kernel("gemm_small", 0, 10), kernel("gemm_big", 10, 30), kernel("gemm_big", 40, 30)]}
    profile = profile_summary.summarise(trace, steps=1)
    assert "- GEMM" not in profile_summary.render(profile)
    text = profile_summary.render(profile, kernels_per_group=1)
    assert text.splitlines()[-1] == "- GEMM: gemm_big 0.06 ms"


def host(name, ts, dur, tid, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def launch(correlation, ts, tid):
    return {
        "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "pid": 1, "tid": tid,
        "args": {"correlation": correlation},
    }  # fmt: skip


def launched_kernel(name, ts, dur, correlation):
    event = kernel(name, ts, dur)
    event["args"] = {"correlation": correlation}
    return event


# The GPU idles twice: 30 us waiting for the optimizer's host work (main thread), 10 us for a backward function
# (autograd's thread). The gap between two overlapping kernels is not idle time.
GAP_TRACE = {
    "traceEvents": [
        host("ProfilerStep#1", 0, 400, tid=1, cat="user_annotation"),  # a step marker, not an operator
        host("Optimizer.step#AdamW.step", 100, 200, tid=1, cat="user_annotation"),
        host("aten::_foreach_add_", 150, 20, tid=1),
        launch(11, 155, tid=1),
        host("autograd::engine::evaluate_function: MmBackward0", 0, 60, tid=2),
        host("aten::mm", 20, 30, tid=2),
        launch(10, 25, tid=2),
        launched_kernel("gemm_a", 0, 50, correlation=9),
        launched_kernel("gemm_b", 60, 40, correlation=10),  # 10 us idle before it
        launched_kernel("gemm_overlapping", 90, 40, correlation=12),
        launched_kernel("multi_tensor_apply_kernel", 160, 20, correlation=11),  # 30 us idle before it
    ]
}


def test_idle_time_is_charged_to_the_host_operator_that_launched_the_next_kernel():
    gaps = profile_summary.idle_gaps(GAP_TRACE)
    assert [(g.start_us, g.length_us) for g in gaps] == [(50.0, 10.0), (130.0, 30.0)]
    assert gaps[0].kernel_before == "gemm_a" and gaps[0].kernel_after == "gemm_b"
    assert (gaps[0].host_outer, gaps[0].host_inner) == ("autograd::engine::evaluate_function: MmBackward0", "aten::mm")
    assert gaps[1].kernel_before == "gemm_overlapping"  # the kernel that ran last, not the one that started last
    assert (gaps[1].host_outer, gaps[1].host_inner) == ("Optimizer.step#AdamW.step", "aten::_foreach_add_")
    assert [g.length_us for g in profile_summary.idle_gaps(GAP_TRACE, min_us=15)] == [30.0]

    text = profile_summary.render_gaps(gaps, steps=2, count=1)
    assert text.splitlines()[0].startswith("GPU idle 0.0 ms per step in 1 gaps")
    assert "| Optimizer.step#AdamW.step | 0.01 | 0 |" in text  # 30 us over 2 steps, largest first
    assert text.index("Optimizer.step") < text.index("MmBackward0")
    assert text.splitlines()[-1].startswith("- 0.03 ms at +0.1 ms: after gemm_overlapping, before multi_tensor")


def test_a_kernel_without_its_launch_in_the_trace_is_charged_to_no_operator(tmp_path, capsys):
    trace = {"traceEvents": [launched_kernel("a", 0, 10, correlation=1), launched_kernel("b", 20, 10, correlation=2)]}
    (gap,) = profile_summary.idle_gaps(trace)
    assert gap.host_outer == profile_summary.NO_HOST_OP
    late = {"traceEvents": [launched_kernel("a", 5_000, 10, 1), launched_kernel("b", 5_020, 10, 2)]}
    assert profile_summary.idle_gaps(late)[0].start_us == 10.0  # counted from the trace's first kernel
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(GAP_TRACE))
    assert profile_summary.main([str(path), "--steps", "1", "--gaps", "2"]) == 0
    out = capsys.readouterr().out
    assert "| GEMM |" in out and "GPU idle 0.0 ms per step in 2 gaps" in out


def sync(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {}}


def test_queue_lead_per_tenth_of_a_step_and_the_host_calls_that_waited():
    # One 1,000 us step. Early on the host is 200 us ahead (kernels start 200 us after their launch); a
    # cudaStreamSynchronize inside the loss's .item() empties the queue, and after it every kernel starts 5 us after
    # its launch: the host is behind.
    events = [
        host("ProfilerStep#7", 0, 1000, tid=1, cat="user_annotation"),
        host("ProfilerStep#7", 10, 990, tid=9, cat="gpu_user_annotation"),  # Kineto's copy on the GPU timeline
        host("aten::item", 390, 120, tid=1),
        sync("cudaStreamSynchronize", 400, 100),
        sync("cudaLaunchKernel", 950, 1500),  # a launch this slow is listed too
    ]
    for index, launched in enumerate((10, 110, 210, 310)):
        events += [launch(index, launched, tid=1), launched_kernel(f"gemm_{index}", launched + 200, 50, index)]
    for index, launched in enumerate((520, 620, 720, 820, 920), start=10):
        events += [launch(index, launched, tid=1), launched_kernel(f"gemm_{index}", launched + 5, 50, index)]
    queue = profile_summary.queue_profile({"traceEvents": events}, steps=1)
    assert queue.step_names == ["ProfilerStep#7"]
    (leads,) = queue.lead_us
    assert leads[:4] == [200.0, 200.0, 200.0, 200.0]
    assert math.isnan(leads[4])  # nothing launched while the host waited
    assert leads[5:] == [5.0] * 5
    assert queue.kernels == [[1, 1, 1, 1, 0, 1, 1, 1, 1, 1]]
    assert queue.blocking["cudaStreamSynchronize"] == (100.0, 1, "aten::item > aten::item")
    assert queue.blocking["cudaLaunchKernel"][:2] == (1500.0, 1)
    assert "cudaLaunchKernel" not in {name for name, (total, _, _) in queue.blocking.items() if total < 1000}

    text = profile_summary.render_queue(queue)
    assert "| 7 | 1.0 | 0.20 (1) | 0.20 (1) | 0.20 (1) | 0.20 (1) | nan (0) | 0.01 (1) |" in text
    assert text.index("cudaLaunchKernel") < text.index("cudaStreamSynchronize")  # longest total first


def test_queue_needs_step_markers(tmp_path, capsys):
    with pytest.raises(ValueError, match="ProfilerStep"):
        profile_summary.queue_profile({"traceEvents": [launched_kernel("a", 0, 10, correlation=1)]}, steps=1)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(GAP_TRACE))
    assert profile_summary.main([str(path), "--steps", "1", "--queue"]) == 0
    out = capsys.readouterr().out
    assert "No host call waited for the GPU." in out
    # ProfilerStep#1 (400 us): gemm_b launched at 25 us, started 35 us later; the optimizer's kernel at 155 us, 5 us.
    assert "| 1 | 0.4 | 0.04 (1) | nan (0) | nan (0) | 0.01 (1) | nan (0) |" in out


def test_kernel_origins_name_the_host_operators_that_launch_matching_kernels(tmp_path, capsys):
    rows = profile_summary.kernel_origins(GAP_TRACE, steps=2, pattern="GEMM_[ab]|multi_tensor")
    assert rows == [  # largest first; the pattern ignores case
        (profile_summary.NO_HOST_OP, profile_summary.NO_HOST_OP, 0.025, 0),  # gemm_a: its launch is not in the trace
        ("autograd::engine::evaluate_function: MmBackward0", "aten::mm", 0.02, 0),  # gemm_b: 40 us over 2 steps
        ("Optimizer.step#AdamW.step", "aten::_foreach_add_", 0.01, 0),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(GAP_TRACE))
    assert profile_summary.main([str(path), "--steps", "1", "--origin", "multi_tensor"]) == 0
    out = capsys.readouterr().out
    assert "| Optimizer.step#AdamW.step | aten::_foreach_add_ | 0.02 | 1 |" in out
    with pytest.raises(SystemExit):
        profile_summary.main([str(path), "--steps", "1", "--origin", "gemm["])
    assert "is not a regular expression" in capsys.readouterr().err
