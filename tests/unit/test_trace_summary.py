"""megatron_ext/bench/trace_summary.py on a hand-made Chrome trace: steps counted from the
profiler's ranges, kernel time by kind, busy and idle time; and bench_training's --profile-steps."""

import gzip
import json
import os
import runpy

import pytest

from megatron_ext.bench.trace_summary import (busy_ratios, categorize, load_trace, package_kernel_names,
                                              summarize_trace)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def two_steps():
    """Two profiled steps; in each (us): our route kernel 10, a grouped GEMM 100, a cuBLAS GEMM 40,
    an elementwise kernel 5, a 20-byte copy 2, and 23 us with nothing running."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": 1000 * n, "dur": 900}
              for n in (11, 12, 13)]  # the host opens step 13 before the profiler stops: no kernel in it
    # as torch writes them: one device range per step and stream that ran in it
    events += [{"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{n}", "ts": 1000 * n, "dur": 200,
                "tid": stream} for n in (11, 12) for stream in (7, 13)]
    events.append({"ph": "i", "cat": "kernel", "name": "not a span", "ts": 0})  # instant events are skipped
    for base in (11000, 12000):
        events += [kernel("_route_kernel", base, 10), kernel("void cutlass::Kernel<GroupedGemm>", base + 10, 100),
                   kernel("nvjet_tst_128x256", base + 120, 40), kernel("vectorized_elementwise_kernel", base + 160, 5),
                   kernel("Memcpy DtoD", base + 165, 2, cat="gpu_memcpy"),
                   kernel("_route_kernel", base + 180, 10)]  # 13 us idle before it
    return events


def test_kinds_busy_and_idle_per_step():
    summary = summarize_trace(two_steps(), top=3)
    assert summary["steps"] == 2
    ms = {name: entry["ms_per_step"] for name, entry in summary["categories"].items()}
    assert ms == pytest.approx({"megatron_ext Triton kernels": 0.020, "grouped GEMM (experts)": 0.100,
                                "GEMM (cuBLAS, CUTLASS)": 0.040, "other (elementwise, norms, reductions, loss)": 0.005,
                                "copies": 0.002})
    assert summary["device_ms_per_step"] == pytest.approx(0.167)
    assert list(summary["categories"])[0] == "grouped GEMM (experts)"  # largest first
    timeline = summary["timeline"]
    # per step: [0, 110) [120, 167) [180, 190) busy = 167 us; the span across both steps runs from
    # 11000 to 12190 (1190 us, 595 per step), so idle includes the 810 us between the steps.
    assert timeline["busy_ms_per_iter"] == pytest.approx(0.167)
    assert timeline["span_ms_per_iter"] == pytest.approx(0.595)
    assert timeline["idle_ms_per_iter"] == pytest.approx(0.595 - 0.167)
    top = summary["top_kernels"]
    assert [k["name"] for k in top] == ["void cutlass::Kernel<GroupedGemm>", "nvjet_tst_128x256", "_route_kernel"]
    assert top[2]["calls_per_step"] == 2 and top[2]["ms_per_step"] == pytest.approx(0.020)


def test_package_kernels_are_found_in_the_source():
    names = package_kernel_names()
    assert {"_route_kernel", "_swiglu_fwd_kernel", "_put_rows_kernel", "_wgrad_accumulate_kernel"} <= names
    assert "_copy_row" not in names  # a helper, not a launched kernel
    assert categorize("_swiglu_bwd_kernel", "kernel", names) == "megatron_ext Triton kernels"
    assert categorize("softmax_warp_forward", "kernel", names) == "softmax"
    assert categorize("multi_tensor_apply_kernel<AdamFunctor>", "kernel", names) == "optimizer"
    assert categorize("Memset (Device)", "gpu_memset", names) == "fills"
    # names as an H100 trace of torch 2.11 spells them
    grouped_mm = ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13"
                  "GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS")
    assert categorize(grouped_mm, "kernel", names) == "grouped GEMM (experts)"
    assert categorize("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "kernel", names) == "GEMM (cuBLAS, CUTLASS)"
    assert categorize("memcpy128", "kernel", names) == "copies"  # a copy node of a CUDA graph
    onerank = ("__nv_static_32__b4148644_10_onerank_cu_fdf47990__ZN43_GLOBAL__N__b4148644_10_onerank_cu_"
               "fdf4799013oneRankReduceI13Func")
    assert categorize(onerank, "kernel", names) == "NCCL"


def test_a_trace_without_steps_or_device_activity_is_refused(tmp_path):
    events = two_steps()
    with pytest.raises(ValueError, match="no ProfilerStep"):
        summarize_trace([e for e in events if not e["name"].startswith("ProfilerStep")])
    with pytest.raises(ValueError, match="CUDA activity was not recorded"):
        summarize_trace([e for e in events if e["cat"] in ("user_annotation", "gpu_user_annotation")])
    host_ranges_only = [e for e in events if e["cat"] != "gpu_user_annotation"]
    assert summarize_trace(host_ranges_only)["steps"] == 3  # without device ranges, the host's names
    path = tmp_path / "rank-0.json.gz"  # the form Megatron writes
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    assert summarize_trace(load_trace(path))["steps"] == 2


def test_bench_training_profile_steps(monkeypatch, tmp_path):
    """--profile-steps trains each variant once more with Megatron's profiler flags and summarizes
    the trace Megatron writes beside the TensorBoard folder; a run without a trace is reported."""
    bench = runpy.run_path(os.path.join(REPO_ROOT, "tools", "bench_training.py"), run_name="tool")
    assert bench["profile_steps"]("11:13") == (11, 13)
    for bad in ("13:11", "0:2", "x:3", "11"):
        with pytest.raises(Exception, match="START"):
            bench["profile_steps"](bad)
    calls = []

    def fake_train(case, args, output_dir, label, metrics):
        calls.append(args)
        folder = args[args.index("--tensorboard-dir") + 1]
        trace = os.path.join(os.path.dirname(folder), "torch_profile")
        if "--moe-ext-cuda-graphs" not in args:  # the graphed variant "forgets" its trace
            os.makedirs(trace)
            with gzip.open(os.path.join(trace, "rank-0.json.gz"), "wt") as handle:
                json.dump({"traceEvents": two_steps()}, handle)
        return {}

    profile_variant = bench["profile_variant"]
    monkeypatch.setitem(profile_variant.__globals__, "train_variant", fake_train)
    options = type("Options", (), {"profile_steps": (11, 13), "extra_args": "--seed 7"})()
    good = profile_variant(None, "rowwise", options, str(tmp_path))
    assert good["steps"] == 2 and good["device_ms_per_step"] == pytest.approx(0.167)
    args = calls[0]
    assert args[args.index("--train-iters") + 1] == "14" and "--use-pytorch-profiler" in args
    assert args[args.index("--profile-step-start") + 1] == "11" and args[args.index("--profile-step-end") + 1] == "13"
    assert args.index("--seed") < args.index("--profile")  # the case's extra flags, then the profiler's
    missing = profile_variant(None, "rowwise_graphs", options, str(tmp_path))
    assert missing["failed"].startswith("FileNotFoundError")


def test_busy_ratios_against_megatron():
    """The device-bound speed-up: Megatron's busy time per step over each variant's."""
    fast = summarize_trace(two_steps())  # 0.167 ms busy per step
    slow = summarize_trace([dict(e, ts=2 * e["ts"], dur=2 * e["dur"]) if e["ph"] == "X" else e
                            for e in two_steps()])  # the same trace at half the speed
    assert slow["timeline"]["busy_ms_per_iter"] == pytest.approx(0.334)
    ratios = busy_ratios({"megatron": slow, "rowwise": fast, "broken": {"failed": "no trace"}})
    assert ratios == pytest.approx({"megatron": 1.0, "rowwise": 2.0})
    assert busy_ratios({"rowwise": fast}) == {}  # no Megatron profile: nothing to compare
    assert busy_ratios({"megatron": {"failed": "x"}, "rowwise": fast}) == {}


def test_category_shares_and_fills_count():
    """A fill (gpu_memset) is device time like a kernel or copy: it counts in the kernel total and
    in its own category. Each category's share is its time over the total, by hand per step (us):
    Triton 20, grouped GEMM 100, GEMM 40, other 5, copies 2, fills 3 = 170."""
    events = two_steps()
    events += [kernel("Memset (Device)", base + 170, 3, cat="gpu_memset") for base in (11000, 12000)]
    summary = summarize_trace(events)
    assert summary["device_ms_per_step"] == pytest.approx(0.170)
    assert summary["categories"]["fills"]["ms_per_step"] == pytest.approx(0.003)
    shares = {name: entry["share"] for name, entry in summary["categories"].items()}
    assert shares == pytest.approx({"megatron_ext Triton kernels": 20 / 170, "grouped GEMM (experts)": 100 / 170,
                                    "GEMM (cuBLAS, CUTLASS)": 40 / 170,
                                    "other (elementwise, norms, reductions, loss)": 5 / 170,
                                    "copies": 2 / 170, "fills": 3 / 170})
    assert summary["timeline"]["busy_ms_per_iter"] == pytest.approx(0.170)  # [170, 173) is busy too
