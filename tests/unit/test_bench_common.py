"""megatron_ext.bench's shared measurement parts (FLOP formula, result JSON, median, CPU timing
fallback, profile bookkeeping) and the paths it finds from its own file."""

import json
import pathlib

import pytest
import torch

from megatron_ext.bench import repo_paths
from megatron_ext.bench.flops import moe_model_flops
from megatron_ext.bench.kernel_profile import device_gaps, kernel_differences, profile_kernels
from megatron_ext.bench.measurement import host_time_ms, median
from megatron_ext.bench.results import write_result

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_moe_model_flops_reference_shape_by_hand():
    # 8192 tokens x top-8 = 65536 rows; fc1 2048 -> 2048 (gate+up of 1024), fc2 1024 -> 2048.
    rows = 65536
    fc1 = 2 * rows * 2048 * 2048
    fc2 = 2 * rows * 1024 * 2048
    assert moe_model_flops(8192, 8, 2048, 1024, backward=False) == fc1 + fc2 == 824_633_720_832
    assert moe_model_flops(8192, 8, 2048, 1024) == 3 * (fc1 + fc2) == 2_473_901_162_496


def test_moe_model_flops_small_plain_mlp():
    # 3 tokens x top-2, hidden 5, ffn 7, no gate: 2*6*(5*7 + 7*5) = 840 forward.
    assert moe_model_flops(3, 2, 5, 7, gated=False, backward=False) == 840
    assert moe_model_flops(3, 2, 5, 7, gated=False) == 2520
    # Gated: 2*6*(5*14 + 7*5) = 1260 forward.
    assert moe_model_flops(3, 2, 5, 7, backward=False) == 1260


def test_median():
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([4, 1, 3, 2]) == 2.5


def test_write_result_json_into_given_dir(tmp_path):
    payload = {"shape": "tiny", "ms": [1.5, 2.5]}
    first = write_result("demo", payload, results_dir=tmp_path / "results")
    second = write_result("demo", payload, results_dir=tmp_path / "results")
    assert first.parent == tmp_path / "results" and first != second, "results must not overwrite each other"
    assert first.name.startswith("demo_") and first.suffix == ".json"
    stamp = first.stem[len("demo_"):]
    assert len(stamp) == 15 and stamp[8] == "-" and stamp.replace("-", "").isdigit()
    data = json.loads(first.read_text())
    assert data["name"] == "demo" and data["result"] == payload
    for key in ("device", "torch", "triton", "megatron_core", "cuda", "date"):
        assert key in data["env"], key
    rewritten = write_result("demo", {"ms": [1.0]}, path=first)  # a long tool saving as it goes
    assert rewritten == first and json.loads(first.read_text())["result"] == {"ms": [1.0]}
    assert data["env"]["torch"]


def test_host_time_counts_every_call():
    calls = []
    times = host_time_ms(lambda: calls.append(1), warmup=2, iters=5)
    assert len(times) == 5 and len(calls) == 7
    assert all(t >= 0.0 for t in times)


def test_profile_counts_syncs_inside_each_iteration_only():
    # CPU has no CUDA runtime events: a record_function named like the runtime call stands in.
    def fn():
        with torch.profiler.record_function("cudaStreamSynchronize"):
            torch.ones(4).sum()

    result = profile_kernels(fn, iters=3, top=4)
    assert result["host_syncs_per_iter"] == 1.0
    assert sum(result["host_sync_sites"].values()) == 3
    names = [op["name"] for op in result["top_host_ops"]]
    assert "aten::sum" in names and "bench_iteration" not in names
    assert result["top_kernels"] == [] and result["kernel_ms_per_iter"] == 0.0


def test_device_gaps_against_a_brute_force_timeline():
    """Random overlapping intervals on an integer clock: busy and idle time against marking every
    microsecond, the gaps' count, length and neighbours against a scan of that marking."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        intervals = []
        for i in range(rng.randint(1, 12)):
            start = rng.randint(0, 80)
            intervals.append((start, start + rng.randint(0, 15), f"k{i}"))
        marks = [False] * 100
        for start, end, _ in intervals:
            for t in range(start, end):
                marks[t] = True
        first, last = min(s for s, _, _ in intervals), max(e for _, e, _ in intervals)
        busy = sum(marks[first:last])
        timeline = device_gaps(intervals, iters=2, top=50)
        assert timeline["span_ms_per_iter"] == (last - first) / 1e3 / 2
        # a zero-length activity marks no microsecond but still splits a gap: compare on real ones
        if all(e > s for s, e, _ in intervals):
            assert abs(timeline["busy_ms_per_iter"] - busy / 1e3 / 2) < 1e-12
            idle_runs = []
            t = first
            while t < last:
                if not marks[t]:
                    run = t
                    while not marks[t]:
                        t += 1
                    idle_runs.append(t - run)
                t += 1
            assert sorted(g["us"] for g in timeline["top_gaps"]) == sorted(idle_runs)
            assert timeline["gaps_per_iter"] == len(idle_runs) / 2
        for gap in timeline["top_gaps"]:  # the neighbours: one ends where the gap starts, one starts where it ends
            ends = {e for s, e, n in intervals if n == gap["after"]}
            starts = {s for s, e, n in intervals if n == gap["before"]}
            assert any(s - e == gap["us"] for e in ends for s in starts)
    empty = device_gaps([], iters=3)
    assert empty["span_ms_per_iter"] == 0.0 and empty["top_gaps"] == []


def test_kernel_differences_by_name_largest_first():
    def profile(**ms):
        return {"top_kernels": [{"name": name, "ms_per_iter": value} for name, value in ms.items()]}
    eager = profile(gemm=3.0, put=0.2, copy=0.05)
    graph = profile(gemm=3.1, put=0.2, staging=0.04)
    rows = kernel_differences(eager, graph, top=3)
    assert [row["name"] for row in rows] == ["gemm", "copy", "staging"]
    assert rows[0]["first_ms"] == 3.0 and rows[0]["second_ms"] == 3.1
    assert abs(rows[0]["difference_ms"] - 0.1) < 1e-12
    assert rows[1] == {"name": "copy", "first_ms": 0.05, "second_ms": 0.0, "difference_ms": -0.05}
    assert rows[2]["difference_ms"] == 0.04
    assert len(kernel_differences(eager, graph)) == 4  # put, unchanged, still listed


def test_repo_paths_resolve_to_this_checkout():
    """The library computes the checkout's folders from its own file; after moving into the
    package they must still name this repository's folders."""
    assert repo_paths.REPO_ROOT == REPO
    assert repo_paths.RESULTS_DIR == REPO / "bench" / "results"
    assert (repo_paths.FUNCTIONAL_CASES_DIR / "gpt" / "tiny_moe_rowwise_cpu_ep2" / "model_config.yaml").is_file()
    assert (repo_paths.REPO_ROOT / "examples" / "pretrain_gpt.py").is_file()


def test_interleaved_ms_charges_host_drift_to_every_step():
    """Two steps, B twice A's cost, on a 'host' that gets 50% slower every round: the absolute times
    drift, the A/B ratio does not, and the steps were timed in turns. A simulated clock (each step
    returns its cost, the timer reports it) keeps the figures exact on a loaded CI machine."""
    from megatron_ext.bench.measurement import interleaved_ms

    calls, slowdown = [], [1.0]

    def simulated_ms(fn, warmup, iters):
        for _ in range(warmup):
            fn()
        return [fn() for _ in range(iters)]

    def busy(name, ms):
        def step():
            calls.append(name)
            return ms * slowdown[0]
        return step

    a, b = busy("a", 1.0), busy("b", 2.0)

    def drift_then_a():
        if calls and calls.count("a") % 3 == 0:  # each new round (1 warm-up + 2 timed calls): 50% slower
            slowdown[0] *= 1.5
        return a()

    result = interleaved_ms({"a": drift_then_a, "b": b}, rounds=3, iters=2, timer=simulated_ms)
    assert calls == (["a"] * 3 + ["b"] * 3) * 3, "timed in turns, one round after another"
    assert result["a"]["rounds"] == 3 and result["a"]["ratio_to_a"] == 1.0
    assert result["b"]["round_ms"] == pytest.approx([2.0, 3.0, 4.5]), "the host drifted"
    assert (result["b"]["min_ms"], result["b"]["median_ms"], result["b"]["max_ms"]) == pytest.approx((2.0, 3.0, 4.5))
    assert result["b"]["ratio_to_a"] == pytest.approx(2.0), result["b"]  # the drift hit both steps alike
    assert (result["b"]["ratio_min_to_a"], result["b"]["ratio_max_to_a"]) == pytest.approx((2.0, 2.0))


def test_interleaved_ms_refuses_no_rounds():
    import pytest

    from megatron_ext.bench.measurement import interleaved_ms

    with pytest.raises(ValueError, match="rounds and iters must be >= 1, got 0 and 3"):
        interleaved_ms({"a": lambda: None}, rounds=0, iters=3)



def test_profile_pair_and_its_printout(capsys):
    """bench_graphs / bench_dropless_arena --profile: both steps profiled (CPU callables here: no
    device kernels, so no differences), and the printout has the two timelines and one row per
    kernel difference."""
    from megatron_ext.bench.kernel_profile import print_profile_pair, profile_pair

    a = torch.randn(64, 64)
    profile = profile_pair({"eager": lambda: a @ a, "graph": lambda: (a @ a).sort(dim=1)})
    assert set(profile["timeline"]) == set(profile["kernel_ms_per_iter"]) == {"eager", "graph"}
    assert profile["kernel_differences"] == []
    profile["kernel_differences"] = [{"name": "gemm", "first_ms": 3.0, "second_ms": 3.1, "difference_ms": 0.1},
                                     {"name": "staging copy", "first_ms": 0.0, "second_ms": 0.02,
                                      "difference_ms": 0.02}]
    print_profile_pair("at 64 tokens", profile)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[0] == "profile at 64 tokens (ms per step):" and len(lines) == 6
    assert lines[4].split() == ["3.000", "3.100", "+0.100", "gemm"]
    with pytest.raises(ValueError, match="compares two steps, got 1"):
        profile_pair({"eager": lambda: a @ a})


def test_bench_graphs_clock_figures_give_energy_per_step():
    """A mode's clock figures are medians over its sampled runs (a run without samples is left out),
    and its energy per step is that power times the step time (W x ms = mJ)."""
    from tools.bench_graphs import clock_figures

    runs = [{"samples": 50, "sm_mhz_median": 1665.0, "power_w_median": 690.0, "power_capped_fraction": 0.9,
             "power_limit_w": 700.0},
            {"samples": 0, "unavailable": "no sample taken"},
            {"samples": 40, "sm_mhz_median": 1725.0, "power_w_median": 670.0, "power_capped_fraction": 0.7,
             "power_limit_w": 700.0}]
    figures = clock_figures(runs, step_ms=5.5)
    assert figures["sm_mhz"] == 1695.0 and figures["power_w"] == 680.0
    assert abs(figures["power_capped_fraction"] - 0.8) < 1e-12 and figures["power_limit_w"] == 700.0
    assert figures["energy_mj_per_step"] == 680.0 * 5.5
    unsampled = clock_figures([{"samples": 0}], step_ms=5.5)
    assert unsampled["power_w"] is None and unsampled["energy_mj_per_step"] is None


def test_interleaved_ms_reports_the_spread_of_per_round_ratios():
    """The A/B figure is the median of per-round ratios, printed with their min..max, and a ratio
    to a step other than the first is also taken round by round (not as a ratio of medians)."""
    from megatron_ext.bench.measurement import interleaved_ms, ratio_in_rounds, ratio_text

    times = iter([10.0, 8.0, 9.0, 12.0, 12.0, 13.0, 10.0, 11.0, 9.0])  # rounds of (a, b, c)

    def timer(step, warmup, iters):
        return [next(times)]

    result = interleaved_ms({"a": None, "b": None, "c": None}, rounds=3, iters=1, timer=timer)
    assert result["b"]["round_ms"] == [8.0, 12.0, 11.0]
    assert result["b"]["ratio_to_a"] == 1.0
    assert (result["b"]["ratio_min_to_a"], result["b"]["ratio_max_to_a"]) == (0.8, 1.1)
    c_over_b = ratio_in_rounds(result, "c", "b")
    assert c_over_b["ratio"] == 13.0 / 12.0 and (c_over_b["min"], c_over_b["max"]) == (9.0 / 11.0, 9.0 / 8.0)
    assert c_over_b["ratio"] != result["c"]["median_ms"] / result["b"]["median_ms"]
    assert ratio_text(result, "b", "a") == "x1.000 (0.800..1.100)"


def test_make_step_ddp_grads_follow_megatrons_main_grad_protocol():
    """grads="ddp": gradients accumulate in fp32 main_grad over the steps (the microbatches of one
    iteration: DDP zeroes it per iteration, not per step), .grad stays empty; grads="param": in
    .grad, reset each step."""
    import pytest

    from megatron_ext.bench.measurement import make_step

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return self.linear(x), None

    torch.manual_seed(0)
    x, grad_out = torch.randn(3, 4), torch.randn(3, 4)
    expected = grad_out.t() @ x
    layer = Layer()
    step = make_step(layer, x, grad_out, grads="ddp")
    step()
    step()
    weight = layer.linear.weight
    assert weight.grad is None and weight.main_grad.dtype == torch.float32
    torch.testing.assert_close(weight.main_grad, 2 * expected)  # two microbatches' gradients
    plain = Layer()
    plain_step = make_step(plain, x, grad_out)
    plain_step()
    plain_step()
    assert not hasattr(plain.linear.weight, "main_grad")
    torch.testing.assert_close(plain.linear.weight.grad, expected)
    with pytest.raises(ValueError, match="grads must be one of"):
        make_step(plain, x, grad_out, grads="fsdp")


def test_every_tool_that_writes_a_result_takes_results_dir(tmp_path):
    """On the GPU machine a run passes --results-dir $OUT so that its own JSON comes back (the device tool
    returns at most 8 files; copying bench/results/*.json once lost a run's file). Every tool that writes a
    result JSON takes the shared flag, and the file lands there."""
    import argparse
    import json
    import pathlib

    from megatron_ext.bench.repo_paths import RESULTS_DIR
    from megatron_ext.bench.results import add_results_dir_arg, write_result

    tools = pathlib.Path(__file__).resolve().parents[2] / "tools"
    calls = ("write_result(", "new_result_path(", "finish_run(")
    writers = [p for p in sorted(tools.glob("*.py")) if any(call in p.read_text() for call in calls)]
    assert len(writers) >= 14, [p.name for p in writers]
    missing = [p.name for p in writers if "add_results_dir_arg(parser)" not in p.read_text()]
    assert not missing, f"tools writing results without --results-dir: {missing}"
    parser = argparse.ArgumentParser()
    add_results_dir_arg(parser)
    assert parser.parse_args([]).results_dir == str(RESULTS_DIR)
    args = parser.parse_args(["--results-dir", str(tmp_path)])
    path = write_result("probe", {"x": 1}, args.results_dir)
    assert path.parent == tmp_path and json.loads(path.read_text())["result"] == {"x": 1}


def test_credited_flops_of_a_path_that_dropped_every_route():
    """The bound is inclusive: a step whose every route was dropped did no expert work and is
    credited 0 (a valid, if bad, measurement), not refused; a quarter dropped keeps 3/4."""
    from megatron_ext.bench.flops import credited_flops

    assert credited_flops(1000.0, routes=4, dropped_routes=4) == 0.0
    assert credited_flops(1000.0, routes=4, dropped_routes=1) == 750.0
    with pytest.raises(ValueError):
        credited_flops(1000.0, routes=4, dropped_routes=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of cuda_time_ms")
def test_cuda_time_ms_on_cpu_warms_up_once_then_times_iters():
    """Without CUDA, cuda_time_ms falls back to wall time: `warmup` untimed calls, then `iters`
    timed ones; the warm-up is neither skipped nor run a second time by the fallback."""
    from megatron_ext.bench.measurement import cuda_time_ms

    calls = []
    times = cuda_time_ms(lambda: calls.append(1), warmup=2, iters=4)
    assert len(times) == 4 and len(calls) == 2 + 4


def test_host_time_ms_is_in_milliseconds(monkeypatch):
    """Per-iteration times are milliseconds: a call that takes 2.5 ms on a simulated perf_counter
    (seconds, as time.perf_counter) reads 2.5, not 2500 or 0.0025."""
    import types

    from megatron_ext.bench import measurement

    clock = [100.0]
    monkeypatch.setattr(measurement, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def step():
        clock[0] += 0.0025

    assert measurement.host_time_ms(step, warmup=1, iters=3) == pytest.approx([2.5, 2.5, 2.5])


def test_interleaved_ms_min_max_span_every_round():
    """min_ms..max_ms are over all rounds, wherever the extreme falls (here the middle round, not
    the last or the first), and ratio_in_rounds counts every round."""
    from megatron_ext.bench.measurement import interleaved_ms, ratio_in_rounds

    times = iter([10.0, 9.0, 10.0, 14.0, 10.0, 11.0])  # rounds of (a, b)

    def timer(step, warmup, iters):
        return [next(times)]

    result = interleaved_ms({"a": None, "b": None}, rounds=3, iters=1, timer=timer)
    assert (result["b"]["min_ms"], result["b"]["median_ms"], result["b"]["max_ms"]) == (9.0, 11.0, 14.0)
    assert ratio_in_rounds(result, "b", "a")["rounds"] == 3


def test_result_env_records_every_field():
    """A result file's env holds exactly these fields (a dropped one silently leaves published
    numbers without their device count, Python or host); on CPU the values are the platform's."""
    import platform

    from megatron_ext.bench.results import env_info

    env = env_info()
    assert set(env) == {"device", "device_count", "torch", "triton", "megatron_core", "cuda", "python", "host",
                        "date"}
    assert env["python"] == platform.python_version() and env["host"] == platform.node()
    assert env["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert env["device_count"] == 0 and env["device"].startswith("cpu (")


def test_three_results_within_one_second_keep_three_files(monkeypatch, tmp_path):
    """Results written within the same second get -1, -2, ... suffixes: none overwrites another
    (a clock frozen at one second makes every stamp the same)."""
    import datetime
    import types

    from megatron_ext.bench import results

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 1, 2, 3, 4, 5)

    monkeypatch.setattr(results, "datetime", types.SimpleNamespace(datetime=Frozen))
    paths = [results.write_result("demo", {"run": i}, results_dir=tmp_path) for i in range(3)]
    assert [p.name for p in paths] == ["demo_20240102-030405.json", "demo_20240102-030405-1.json",
                                       "demo_20240102-030405-2.json"]
    assert [json.loads(p.read_text())["result"]["run"] for p in paths] == [0, 1, 2]


def test_device_gaps_lists_the_longest_gaps_first():
    """With `top` shorter than the gap list, the gaps kept are the longest, longest first:
    gaps (us) a->b 2, b->c 5, c->d 1; top=2 keeps b->c then a->b."""
    intervals = [(0, 10, "a"), (12, 20, "b"), (25, 30, "c"), (31, 40, "d")]
    timeline = device_gaps(intervals, iters=1, top=2)
    assert timeline["top_gaps"] == [{"us": 5, "after": "b", "before": "c"}, {"us": 2, "after": "a", "before": "b"}]
    assert timeline["gaps_per_iter"] == 3  # every gap is counted, not only the listed ones
    assert timeline["idle_ms_per_iter"] == pytest.approx(8 / 1e3)
