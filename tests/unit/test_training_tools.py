"""The tools that train a functional case in variants: tools/mxfp8_loss_curve.py's comparison
(the verdict numbers from two loss curves) and tools/bench_training.py's summary and arguments."""

import math
import os
import runpy

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = runpy.run_path(os.path.join(REPO_ROOT, "tools", "mxfp8_loss_curve.py"), run_name="tool")
BENCH = runpy.run_path(os.path.join(REPO_ROOT, "tools", "bench_training.py"), run_name="tool")


def curve(values):
    return {"lm loss": {"values": {str(step): value for step, value in enumerate(values, start=1)}},
            "iteration-time": {"values": {str(step): 0.1 * step for step in range(1, len(values) + 1)}}}


def test_close_curves_give_a_small_window_difference():
    bf16 = curve([10.0, 9.0, 8.0, 7.0, 6.0])
    mxfp8 = curve([10.0, 9.1, 8.0, 7.06, 6.03])
    result = TOOL["compare"](bf16, mxfp8, window=2, warmup=1)
    assert result["steps"] == [1, 2, 3, 4, 5] and result["window"] == [4, 5]
    assert math.isclose(result["window_mean_bf16"], 6.5) and math.isclose(result["window_mean_mxfp8"], 6.545)
    assert math.isclose(result["window_rel_diff"], 0.045 / 6.5)
    assert math.isclose(result["max_abs_diff"], 0.1, rel_tol=1e-9)
    assert result["all_finite"] and result["loss_fell"]
    assert math.isclose(result["iteration_time_s"]["bf16"], 0.35)  # median of steps 2..5 (after 1 warm-up step)


def test_a_nan_or_a_diverging_curve_is_reported():
    result = TOOL["compare"](curve([10.0, 9.0, 8.0]), curve([10.0, float("nan"), 12.0]), window=1)
    assert not result["all_finite"] and not result["loss_fell"]
    assert math.isclose(result["window_rel_diff"], 0.5)


def test_no_common_steps_is_an_error():
    with pytest.raises(SystemExit, match="no common lm-loss steps"):
        TOOL["compare"](curve([1.0]), {"lm loss": {"values": {"7": 1.0}}}, window=1)


def test_bench_training_summary_uses_steady_steps_and_the_last_losses():
    values = curve([10.0, 8.0, 6.0, 4.0, 3.0, 2.0])
    values["mem-max-allocated-bytes"] = {"values": {"1": 2.0 * 2**30, "6": 3.0 * 2**30}}
    summary = BENCH["summarize"](values, warmup=2, window=2)
    assert summary["steady_steps"] == 4 and math.isclose(summary["iteration_time_s"], 0.45)  # steps 3..6
    assert summary["max_allocated_gib"] == 3.0 and summary["final_loss"] == 2.5


def test_bench_training_rejects_unknown_variants_and_too_few_steps(capsys):
    with pytest.raises(SystemExit):
        BENCH["main"](["--variants", "megatron,nope"])
    assert "unknown variants ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        BENCH["main"](["--train-iters", "5", "--warmup", "10"])
    assert "must exceed --warmup" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        BENCH["main"](["--repeats", "0"])  # nothing would run
    assert "or 0 with --profile-steps" in capsys.readouterr().err


def test_bench_training_summary_without_steady_steps_is_an_error():
    with pytest.raises(ValueError, match="after the 10 warm-up steps"):
        BENCH["summarize"](curve([3.0, 2.0]), warmup=10, window=2)


def test_bench_training_repeats_give_the_median_and_spread_and_a_failed_run_fails_the_variant():
    runs = [{"iteration_time_s": t, "max_allocated_gib": 1.0, "final_loss": 2.0} for t in (0.5, 0.3, 0.4)]
    combined = BENCH["combine_runs"](runs)
    assert combined["iteration_time_s"] == 0.4 and combined["repeats"] == 3
    assert (combined["iteration_time_min_s"], combined["iteration_time_max_s"]) == (0.3, 0.5)
    failed = BENCH["combine_runs"]([runs[0], {"failed": "exit 1"}])
    assert failed["failed"] == "exit 1" and "iteration_time_s" not in failed


def test_bench_training_speedup_is_the_median_of_per_round_ratios():
    """Round i of each variant ran back to back: the speedup is the median of per-round ratios,
    with their min..max, not the ratio of the two medians; a failed round is left out."""
    megatron = [{"iteration_time_s": t} for t in (0.83, 0.78, 1.03)]
    graphs = [{"iteration_time_s": t} for t in (0.1436, 0.1437, 0.1492)]
    spread = BENCH["per_round_speedup"](megatron, graphs)
    ratios = sorted(m["iteration_time_s"] / g["iteration_time_s"] for m, g in zip(megatron, graphs))
    assert spread == {"median": ratios[1], "min": ratios[0], "max": ratios[2], "rounds": 3}
    assert spread["median"] != pytest.approx(0.83 / 0.1437)  # the ratio of the medians
    assert BENCH["per_round_speedup"](megatron, [graphs[0], {"failed": "exit 1"}])["rounds"] == 1
    assert BENCH["per_round_speedup"]([], graphs) is None
