"""Smoke tests of the multi-GPU tools on CPU (issue 11): they must run unchanged on the GPU host.

- tools/bench_ep.py on 2 gloo ranks (torchrun, --device cpu --tiny): the Megatron and rowwise
  torch paths are measured, the symm paths report "not available", the routes are identical
  across paths and the outputs agree; JSON written.
- tools/bench_transport.py on 2 gloo ranks: the torch reference transport's four transfers (the
  symm kernels need GPUs, and the run says so).
- tools/multigpu_check.sh: bash syntax, the dry-run plan, and its usage errors.
- The phase accounting of bench_ep (PhaseTimer) on a toy dispatcher with a counting clock: the
  experts' forward and backward between the dispatcher methods are never charged to them.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(REPO, "tools", script), "--device", "cpu", "--tiny", *args]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def _result(results_dir, name: str) -> dict:
    files = glob.glob(os.path.join(results_dir, f"{name}_*.json"))
    assert len(files) == 1, files
    with open(files[0]) as handle:
        return json.load(handle)


def test_bench_ep_runs_on_two_cpu_ranks(tmp_path):
    proc = _torchrun("bench_ep.py", "--results-dir", str(tmp_path), "--iters", "3", "--warmup", "1")
    out = proc.stdout
    assert "EP2 MoE layer, 2 ranks" in out and "disp+comb ms" in out, out
    for path in ("megatron_alltoall", "megatron_alltoall_gg", "rowwise_torch"):
        assert any(line.startswith(path + " ") and "NOT AVAILABLE" not in line for line in out.splitlines()), out
    for path in ("rowwise_symm", "rowwise_symm_put", "rowwise_symm_mxfp8", "rowwise_symm_graph",
                 "rowwise_symm_dropless", "rowwise_symm_bounded", "megatron_flex_deepep_gg"):  # no GPUs, no deep_ep
        assert any(line.startswith(path) and "NOT AVAILABLE" in line for line in out.splitlines()), out
    assert "dispatch+combine rowwise_torch/megatron_alltoall: ratio" in out
    result = _result(tmp_path, "ep_layer")["result"]
    assert result["world_size"] == 2 and result["same_routes_all_paths"] is True
    rows = {r["path"]: r for r in result["rows"]}
    assert set(rows) == {"megatron_alltoall", "megatron_alltoall_gg", "megatron_flex_deepep_gg", "rowwise_torch",
                         "rowwise_symm", "rowwise_symm_put", "rowwise_symm_mxfp8", "rowwise_symm_graph",
                         "rowwise_symm_dropless", "rowwise_symm_bounded"}
    for path in ("megatron_alltoall", "megatron_alltoall_gg", "rowwise_torch"):
        row = rows[path]
        assert row["layer_fwd_bwd_ms"] > 0 and row["dispatch_combine_ms"] > 0 and row["tflops_per_gpu"] > 0, row
        phases = row["phases_ms"]
        assert phases["token_dispatch_fwd"] > 0 and phases["token_combine_bwd"] > 0, phases
        assert phases["dispatch_combine"] < phases["layer"], phases  # a part of the same iterations
    # Same weights and routes on every path: outputs differ by bf16 rounding only.
    for path in ("megatron_alltoall_gg", "rowwise_torch"):
        assert rows[path]["out_rel_diff_vs_first_path_max_rank"] < 3e-2, rows[path]
    assert rows["rowwise_torch"]["dropped_routes_per_step_all_ranks"] == 0


def test_bench_transport_runs_on_two_cpu_ranks(tmp_path):
    proc = _torchrun("bench_transport.py", "--results-dir", str(tmp_path), "--iters", "3", "--warmup", "1")
    out = proc.stdout
    assert "row transfers over 2 ranks (cpu)" in out and "torch reference transport" in out, out
    assert "not evaluated (no symm kernel rows on this device)" in out, out
    result = _result(tmp_path, "transport")["result"]
    rows = result["rows"]
    transfers = ("dispatch", "dispatch, mxfp8", "combine", "combine_backward", "dispatch_backward")
    assert {(r["tokens"], r["transfer"]) for r in rows} == {(t, name) for t in (64, 128) for name in transfers}
    mxfp8 = [r for r in rows if r["transfer"] == "dispatch, mxfp8"]
    assert all(r["row_bytes"] == 80 for r in mxfp8), mxfp8  # 64 + 64/32 bytes, padded to 16
    for row in rows:
        assert row["transport"] == "torch phase" and row["ms_median"] > 0 and row["gbps_per_gpu_median"] > 0, row
        assert 0.3 < row["remote_fraction"] < 0.7, row  # 2 ranks, balanced routes: about half cross
    assert result["dispatch_target"] is None and result["notes"], result


SCRIPT = os.path.join(REPO, "tools", "multigpu_check.sh")


def test_multigpu_check_script_syntax_and_plan():
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    plan = subprocess.run(["bash", SCRIPT, "--dry-run", "8"], capture_output=True, text=True, env=env, timeout=30)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    out = plan.stdout
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in out
    for expected in ("pytest -q -rs -p no:cacheprovider tests/gpu/test_rowwise_multigpu.py",
                     "pytest -q -rs -p no:cacheprovider tests/gpu/test_rank_death_multigpu.py",
                     "pytest -q -rs -p no:cacheprovider tests/gpu/test_ddp_megatron_gpu.py",
                     "--nproc-per-node 8 tools/bench_transport.py",
                     "--nproc-per-node 8 tools/bench_ep.py",
                     "--nproc-per-node 8 tools/bench_dropless_arena.py"):
        assert expected in out, out
    assert "=== multigpu_check summary (8 GPUs)" in out
    two = subprocess.run(["bash", SCRIPT, "--dry-run", "--steps", "ep,functional", "2"], capture_output=True,
                         text=True, env=env, timeout=30)
    assert two.returncode == 0 and "--nproc-per-node 2 tools/bench_ep.py" in two.stdout, two.stdout
    assert "needs 8 GPUs, this run uses 2" in two.stdout or "does not exist" in two.stdout, two.stdout
    for bad in (["--steps", "nope", "2"], ["3"], ["--frobnicate"]):
        wrong = subprocess.run(["bash", SCRIPT, "--dry-run", *bad], capture_output=True, text=True, env=env,
                               timeout=30)
        assert wrong.returncode == 2, (bad, wrong.stdout, wrong.stderr)


# ----------------------------------------------------------------------------- phase accounting
class CountingClock:
    """Integer timestamps: every stamp is one tick; `advance` stands for device work."""

    cuda = False

    def __init__(self):
        self.now = 0

    def stamp(self):
        self.now += 1
        return self.now

    def advance(self, ticks: int) -> None:
        self.now += ticks

    def ms(self, start, end) -> float:
        return float(end - start)

    def synchronize(self) -> None:
        pass


EXPERT_TICKS = 1000


class _SlowExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, clock):
        ctx.clock = clock
        ctx.save_for_backward(rows, probs)
        clock.advance(EXPERT_TICKS)
        return rows * probs[:, None]

    @staticmethod
    def backward(ctx, grad):
        rows, probs = ctx.saved_tensors
        ctx.clock.advance(EXPERT_TICKS)
        return grad * probs[:, None], (grad * rows).sum(1), None


class ToyDispatcher:
    """The six methods in Megatron's call order, with the same tensor flow as the rowwise path
    (probs kept on the dispatcher between dispatch and combine)."""

    def dispatch_preprocess(self, hidden, routing_map, probs):
        return hidden * 2, probs.gather(1, routing_map.long().argmax(1, keepdim=True)).squeeze(1)

    def token_dispatch(self, hidden, probs):
        return hidden + 1, probs

    def dispatch_postprocess(self, hidden, probs):
        self.probs = probs
        return hidden, torch.tensor([hidden.shape[0]]), None

    def combine_preprocess(self, hidden):
        return hidden

    def token_combine(self, hidden):
        return hidden * self.probs[:, None]

    def combine_postprocess(self, hidden):
        return hidden.view(-1, 1, hidden.shape[-1])


def _toy_step(dispatcher, clock, x, router):
    probs = torch.softmax(x @ router, dim=1)
    routing_map = probs > probs.mean(1, keepdim=True)
    hidden, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    hidden, _, _ = dispatcher.dispatch_postprocess(hidden, p)
    out = _SlowExperts.apply(hidden, dispatcher.probs.detach() + 1, clock)
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(out)))
    out.sum().backward()


def test_phase_timer_charges_only_the_dispatcher_methods():
    from megatron_ext.bench.ep_phase_timing import COMBINE_METHODS, DISPATCH_METHODS, PhaseTimer

    clock, dispatcher = CountingClock(), ToyDispatcher()
    x = torch.randn(16, 8, requires_grad=True)
    router = torch.randn(8, 4, requires_grad=True)
    timer = PhaseTimer(dispatcher, clock)
    for _ in range(3):
        timer.time_step(lambda: _toy_step(dispatcher, clock, x, router))
    rows = timer.per_iteration()
    timer.uninstall()
    assert all(name not in vars(dispatcher) for name in DISPATCH_METHODS + COMBINE_METHODS)
    assert len(rows) == 3
    for row in rows:
        for name in DISPATCH_METHODS + COMBINE_METHODS:
            assert row[f"{name}_fwd"] == 1.0, row  # entry and exit stamps are adjacent
        # Gradients pass every differentiable method; the experts' 2 x 1000 ticks never count.
        for name in ("dispatch_preprocess", "token_dispatch", "token_combine", "combine_postprocess"):
            assert 0 < row[f"{name}_bwd"] < EXPERT_TICKS, (name, row)
        assert row["dispatch_combine"] < EXPERT_TICKS < 2 * EXPERT_TICKS < row["layer"], row
        assert row["dispatch_combine"] == pytest.approx(sum(row[f"{p}_{leg}"] for p in ("dispatch", "combine")
                                                            for leg in ("fwd", "bwd")))


@pytest.mark.parametrize("marks,expected", [
    ([("start", 10), ("end", 14)], 4),
    # a second input's gradient produced by the same backward node adds nothing
    ([("start", 10), ("end", 14), ("end", 15)], 4),
    # an input gradient that arrives with nothing open (the probs a dispatcher keeps for combine)
    ([("end", 3), ("start", 10), ("end", 12)], 2),
    # two chains at different times (probs early, tokens after the experts): the gap is not charged
    ([("start", 0), ("end", 1), ("start", 1000), ("end", 1003)], 4),
    # two outputs whose gradients are inside together: one stretch
    ([("start", 0), ("start", 2), ("end", 5), ("end", 9)], 9),
    ([], 0),
])
def test_backward_stretches(marks, expected):
    from megatron_ext.bench.ep_phase_timing import PhaseTimer

    timer = PhaseTimer.__new__(PhaseTimer)
    timer.clock = CountingClock()
    assert timer._backward_ms(marks) == expected


def test_summary_ratio_and_route_check():
    from megatron_ext.bench.ep_report import dispatch_combine_ratios, same_routes, summarize

    def rank(path, layer, phases, digest):
        return {"path": path, "routing_digest": digest, "layer_ms": layer, "memory": None,
                "blocking_cuda_calls": 0, "out_rel_diff_vs_first_path": None,
                "phases": [{"dispatch_combine": p} for p in phases]}

    megatron = summarize([rank("megatron_alltoall", [10, 12], [6, 6], "a"),
                          rank("megatron_alltoall", [11, 11], [6, 8], "b")], flops=int(1e12))
    symm = summarize([rank("rowwise_symm", [5, 5], [3, 3], "a"), rank("rowwise_symm", [5, 6], [3, 4], "b")],
                     flops=int(1e12))
    missing = summarize([{"path": "rowwise_symm_mxfp8", "unavailable": "not available: x"}] * 2, flops=1)
    assert megatron["layer_fwd_bwd_ms"] == 11 and megatron["layer_fwd_bwd_ms_slowest_rank"] == 11
    assert megatron["dispatch_combine_ms"] == 6 and symm["dispatch_combine_ms"] == 3
    assert megatron["tflops_per_gpu"] == pytest.approx(1e12 / 11 / 1e9)
    assert missing == {"path": "rowwise_symm_mxfp8", "unavailable": "not available: x"}
    ratios = dispatch_combine_ratios([megatron, symm, missing])
    assert ratios == {"rowwise_symm/megatron_alltoall": {"ratio": 0.5, "shorter_by": 0.5}}
    assert same_routes([megatron, symm, missing]) is True
    symm["routing_digests"] = ["a", "c"]
    assert same_routes([megatron, symm]) is False


def test_summary_takes_the_largest_rank_memory():
    from megatron_ext.bench.ep_report import summarize

    def rank(peak, held):
        memory = {"peak_bytes": peak + 100, "peak_above_baseline_bytes": peak}
        if held is not None:
            memory["held_for_backward_bytes"] = held
        return {"path": "rowwise_symm", "routing_digest": "a", "layer_ms": [1.0], "memory": memory,
                "blocking_cuda_calls": 0, "out_rel_diff_vs_first_path": None}

    row = summarize([rank(10, 7), rank(12, 5)], flops=1)
    assert (row["peak_above_baseline_bytes_max_rank"], row["peak_bytes_max_rank"]) == (12, 112)
    assert row["held_for_backward_bytes_max_rank"] == 7
    assert summarize([rank(10, None)] * 2, flops=1)["held_for_backward_bytes_max_rank"] is None  # graph paths


def test_mxfp8_vs_bf16_ratios():
    from megatron_ext.bench.ep_report import mxfp8_vs_bf16

    bf16 = {"path": "rowwise_symm", "dispatch_buffer_bytes": 1000, "phases_ms": {"dispatch_fwd": 2.0}}
    mx = {"path": "rowwise_symm_mxfp8", "dispatch_buffer_bytes": 516, "phases_ms": {"dispatch_fwd": 1.5}}
    assert mxfp8_vs_bf16([bf16, mx]) == {"buffer_bytes_ratio": 0.516, "dispatch_fwd_ratio": 0.75}
    assert mxfp8_vs_bf16([bf16, {"path": "rowwise_symm_mxfp8", "unavailable": "x"}]) == {}


def test_dropped_routes_are_not_credited_as_work():
    """A path that dropped routes is credited T*K minus the dropped routes, not T*K."""
    from megatron_ext.bench.ep_report import summarize
    from megatron_ext.bench.flops import credited_flops, moe_model_flops

    def rank(dropped):
        return {"path": "rowwise_symm", "routing_digest": "a", "layer_ms": [2.0], "memory": None,
                "blocking_cuda_calls": 0, "out_rel_diff_vs_first_path": None, "dropped_routes_per_step": dropped,
                "mean_buffer_fill": 1.0, "capacity_rows": 16}

    tokens, topk = 64, 2
    flops = moe_model_flops(tokens, topk, hidden=32, ffn=16)
    assert credited_flops(flops, tokens * topk, 0) == flops
    assert moe_model_flops(tokens - 8, topk, hidden=32, ffn=16) == credited_flops(flops, tokens * topk, 16)
    row = summarize([rank(16), rank(0)], flops, routes=tokens * topk)  # 8 routes dropped per rank on average
    assert row["dropped_routes_per_step_all_ranks"] == 16
    assert row["credited_flops_per_rank_step"] == pytest.approx(flops * (128 - 8) / 128)
    assert row["tflops_per_gpu"] == pytest.approx(flops * (128 - 8) / 128 / 2.0 / 1e9)
    kept = summarize([rank(0), rank(0)], flops, routes=tokens * topk)
    assert kept["tflops_per_gpu"] == pytest.approx(flops / 2.0 / 1e9)
    with pytest.raises(ValueError):
        credited_flops(flops, 10, 11)


def test_dispatch_combine_total_is_the_sum_of_the_phase_columns():
    """The total the ratios use is the sum of the phase medians the table prints beside it, not
    the median of per-iteration sums (which differ when the iterations are skewed)."""
    from megatron_ext.bench.ep_report import summarize

    iterations = [(1.0, 1.0, 1.0, 1.0), (1.0, 5.0, 1.0, 5.0), (3.0, 1.0, 3.0, 1.0)]
    phases = [{"dispatch_fwd": a, "dispatch_bwd": b, "combine_fwd": c, "combine_bwd": d,
               "dispatch_combine": a + b + c + d, "layer": 10.0 + a + b + c + d} for a, b, c, d in iterations]
    row = summarize([{"path": "megatron_alltoall", "routing_digest": "a", "layer_ms": [9.0], "memory": None,
                      "blocking_cuda_calls": 0, "out_rel_diff_vs_first_path": None, "phases": phases}], flops=1)
    columns = sum(row["phases_ms"][k] for k in ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd"))
    assert columns == 4.0 and row["dispatch_combine_ms"] == columns
    assert row["dispatch_combine_median_of_sums_ms"] == 8.0  # kept beside it, not used for the ratios
    assert row["layer_fwd_bwd_ms_phase_timed"] == 18.0 and row["layer_fwd_bwd_ms"] == 9.0


def test_the_bounded_paths_overflow_reaches_the_row_and_the_table(capsys):
    """bench_ep's bounded path checks its overflow on every rank; the summary keeps it and the
    table prints it (it was computed and thrown away)."""
    from megatron_ext.bench.ep_paths import Shape
    from megatron_ext.bench.ep_report import print_table, summarize

    def rank(overflow):
        return {"path": "rowwise_symm_bounded", "routing_digest": "a", "layer_ms": [2.0], "memory": None,
                "blocking_cuda_calls": 0, "out_rel_diff_vs_first_path": None, "overflow": overflow}

    quiet = summarize([rank("none"), rank("none")], flops=1)
    loud = summarize([rank("MoE layer 1 received more routes"), rank("MoE layer 1 received more routes")], flops=1)
    assert quiet["overflow"] == "none" and loud["overflow"] == "MoE layer 1 received more routes"
    shape = Shape(sequences=1, seq_length=8, experts=4, topk=2, hidden=32, ffn=16)
    print_table([quiet, loud], {}, shape, 2, True)
    out = capsys.readouterr().out
    assert "rowwise_symm_bounded: overflowed its bound: MoE layer 1 received more routes" in out
    assert out.count("overflowed its bound") == 1


def _ep_rank(path="rowwise_symm", **fields):
    rank = {"path": path, "routing_digest": "a", "layer_ms": [1.0], "memory": None, "blocking_cuda_calls": 0,
            "out_rel_diff_vs_first_path": None}
    rank.update(fields)
    return rank


def test_summary_takes_every_rank_and_iteration_into_its_figures():
    """Rank-skewed measurements, so that each figure's rule shows (by hand): the layer time is the
    median over all ranks' iterations (1,2,2.5,3,4,4,4 -> 3, not the median of rank medians 2.5), the
    slowest rank's median is the max (4), the phase medians run over every rank (1,1,5,5 -> 3), the
    sync count and output difference are the worst rank's, the drops are summed over ranks and the
    buffer fill is the median over ranks."""
    from megatron_ext.bench.ep_report import summarize

    ranks = [
        _ep_rank(layer_ms=[1.0, 2.0, 3.0], phases=[{"dispatch_combine": 1.0}] * 2, blocking_cuda_calls=0,
                 out_rel_diff_vs_first_path=1e-3, dropped_routes_per_step=5, mean_buffer_fill=0.5, capacity_rows=8),
        _ep_rank(layer_ms=[4.0, 4.0, 4.0], phases=[{"dispatch_combine": 5.0}] * 2, blocking_cuda_calls=3,
                 out_rel_diff_vs_first_path=2e-3, dropped_routes_per_step=3, mean_buffer_fill=0.9, capacity_rows=8),
        _ep_rank(layer_ms=[2.5], phases=[], blocking_cuda_calls=None, out_rel_diff_vs_first_path=None,
                 dropped_routes_per_step=1, mean_buffer_fill=0.7, capacity_rows=8),
    ]
    row = summarize(ranks, flops=1)
    assert row["layer_fwd_bwd_ms"] == 3.0  # 1, 2, 2.5, 3, 4, 4, 4; rank medians 2, 4, 2.5
    assert row["layer_fwd_bwd_ms_slowest_rank"] == 4.0
    assert row["phases_ms"] == {"dispatch_combine": 3.0} and row["dispatch_combine_ms"] == 3.0
    assert row["blocking_cuda_calls_max_rank"] == 3
    assert row["out_rel_diff_vs_first_path_max_rank"] == 2e-3
    assert row["dropped_routes_per_step_all_ranks"] == 9
    assert row["mean_buffer_fill"] == 0.7


def test_layer_ratios_are_rowwise_over_megatron():
    """rowwise_symm's layer time over each grouped-GEMM Megatron path's: 5 ms over 10 ms is 0.5."""
    from megatron_ext.bench.ep_report import layer_ratios

    rows = [{"path": "rowwise_symm", "layer_fwd_bwd_ms": 5.0},
            {"path": "megatron_alltoall_gg", "layer_fwd_bwd_ms": 10.0},
            {"path": "megatron_flex_deepep_gg", "layer_fwd_bwd_ms": 4.0}]
    assert layer_ratios(rows) == {"rowwise_symm/megatron_alltoall_gg": 0.5,
                                  "rowwise_symm/megatron_flex_deepep_gg": 1.25}


@pytest.mark.parametrize("ratio,shorter_by,verdict", [(0.6, 0.4, "MET"), (0.65, 0.35, "MET"), (0.7, 0.3, "NOT MET")])
def test_issue_11_target_is_35_percent_shorter(ratio, shorter_by, verdict, capsys):
    """The printed verdict: MET when rowwise symm's dispatch+combine is at least 35% shorter than
    Megatron alltoall's (ratio <= 0.65), NOT MET otherwise."""
    from megatron_ext.bench.ep_paths import Shape
    from megatron_ext.bench.ep_report import print_table

    shape = Shape(sequences=1, seq_length=8, experts=4, topk=2, hidden=32, ffn=16)
    ratios = {"rowwise_symm/megatron_alltoall": {"ratio": ratio, "shorter_by": shorter_by}}
    print_table([], ratios, shape, 2, True)
    target = [line for line in capsys.readouterr().out.splitlines() if line.startswith("issue 11 target")]
    assert len(target) == 1 and target[0].endswith(": " + verdict), target
