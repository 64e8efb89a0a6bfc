"""Functional-test machinery without training (megatron_ext.bench.functional and the runner CLI):
comparison with Megatron's tolerances (including cases that MUST fail; time and memory fail only
on regressions), log parsing, case files, and the runner's no-golden-values answer. Every case's
and example script's flags are parsed by Megatron's parser with the hook installed."""

import math
import os
import runpy
import shlex
import subprocess
import sys

import pytest

from megatron_ext.bench.functional import case_config, case_run, compare, log_metrics, training
from tests.functional_tests import runner

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def golden(series):
    return compare.to_golden_format(series)


def losses(n=100, start=10.0):
    return {step: start - 0.05 * step for step in range(1, n + 1)}


def failed(results):
    return [r for r in results if not r.passed]


# ---- comparison ---------------------------------------------------------------------------------

def test_identical_values_pass_every_check():
    values = {"lm loss": golden(losses()), "num-zeros": golden({s: 100.0 for s in range(1, 101)})}
    results = compare.compare_metrics(values, values, ["lm loss", "num-zeros"], allow_nondeterministic=False)
    assert len(results) == 4 and not failed(results)


def test_perturbed_golden_values_must_fail():
    actual = {"lm loss": golden(losses())}
    perturbed = {"lm loss": golden({s: v * (1.10 if s % 2 else 1.0) for s, v in losses().items()})}  # 50 steps off 10%
    results = compare.compare_metrics(perturbed, actual, ["lm loss"], allow_nondeterministic=False)
    assert {r.test for r in failed(results)} == {"deterministic", "approximate (rtol 0.05)"}
    assert "50 of 100 steps differ (allowed 1)" in failed(results)[1].message


def test_tiny_difference_fails_only_the_exact_check():
    actual = {"lm loss": golden(losses())}
    nudged = {"lm loss": golden({s: v + (1e-6 if s == 7 else 0.0) for s, v in losses().items()})}
    results = compare.compare_metrics(nudged, actual, ["lm loss"], allow_nondeterministic=False)
    assert [r.test for r in failed(results)] == ["deterministic"]
    assert "step 7" in failed(results)[0].message
    assert not failed(compare.compare_metrics(nudged, actual, ["lm loss"], allow_nondeterministic=True))


def test_nondeterministic_cases_skip_the_exact_check():
    values = {"lm loss": golden(losses())}
    results = compare.compare_metrics(values, values, ["lm loss"], allow_nondeterministic=True)
    assert [r.test for r in results] == [compare.INFORMATIONAL_EXACT, "approximate (rtol 0.05)"]
    assert results[0].passed and "100 of 100 steps bitwise equal" in results[0].message


@pytest.mark.parametrize("n,allowed", [(10, 1), (99, 1), (100, 1), (250, 2), (5000, 50), (100000, 50)])
def test_allowed_failing_steps_follow_megatron(n, allowed):
    assert compare.allowed_failing_steps(n) == allowed


def test_approximate_check_tolerates_exactly_the_allowance():
    base = losses(200)
    one_bad = {s: v * (1.5 if s in (3, 150) else 1.0) for s, v in base.items()}  # 2 bad of 200: allowed 2
    three_bad = {s: v * (1.5 if s in (3, 150, 199) else 1.0) for s, v in base.items()}
    kwargs = dict(metrics=["lm loss"], allow_nondeterministic=True)
    assert not failed(compare.compare_metrics({"lm loss": golden(one_bad)}, {"lm loss": golden(base)}, **kwargs))
    assert failed(compare.compare_metrics({"lm loss": golden(three_bad)}, {"lm loss": golden(base)}, **kwargs))


def test_num_zeros_uses_rtol_020():
    base = {s: 100.0 for s in range(1, 11)}
    within = {s: 119.0 for s in range(1, 11)}
    beyond = {s: 121.0 for s in range(1, 11)}
    kwargs = dict(metrics=["num-zeros"], allow_nondeterministic=True)
    assert not failed(compare.compare_metrics({"num-zeros": golden(base)}, {"num-zeros": golden(within)}, **kwargs))
    assert failed(compare.compare_metrics({"num-zeros": golden(base)}, {"num-zeros": golden(beyond)}, **kwargs))


def test_iteration_time_compares_the_steady_window_median():
    golden_time = {s: (5.0 if s <= 2 else 0.100) for s in range(1, 51)}  # slow startup steps
    actual_fast_start = {s: 0.103 for s in range(1, 51)}
    actual_slow = {s: 0.110 for s in range(1, 51)}
    kwargs = dict(metrics=["iteration-time"], allow_nondeterministic=True)
    ok = compare.compare_metrics({"iteration-time": golden(golden_time)},
                                 {"iteration-time": golden(actual_fast_start)}, **kwargs)
    assert not failed(ok) and "median" in ok[0].message
    assert failed(compare.compare_metrics({"iteration-time": golden(golden_time)},
                                          {"iteration-time": golden(actual_slow)}, **kwargs))
    slow_first_half = {"iteration-time": golden({s: (0.2 if s <= 25 else 0.1) for s in range(1, 51)})}
    flat = {"iteration-time": golden({s: 0.1 for s in range(1, 51)})}
    assert not failed(compare.compare_metrics(flat, slow_first_half, **kwargs))
    window = compare.compare_metrics(flat, slow_first_half, steady_window=(1, 25), **kwargs)
    assert failed(window) and "steps 1..25" in window[0].message, "the configured window is the one compared"


def _steady(value, steps=50):
    return golden({s: value for s in range(1, steps + 1)})


def test_a_faster_run_passes_and_says_by_how_much():
    # The single-GPU case on another H200: bitwise-identical losses, 0.3438 s per step against
    # the golden 0.444 s (the case's rtol 0.15); a two-sided check failed it.
    results = compare.compare_metrics({"iteration-time": _steady(0.444)}, {"iteration-time": _steady(0.3438)},
                                      ["iteration-time"], allow_nondeterministic=False,
                                      rtol_overrides={"iteration-time": 0.15})
    assert [r.passed for r in results] == [True]
    assert "faster by 22.6% (an improvement)" in results[0].message, results[0].message
    assert "fails only when slower" in results[0].test


def test_a_slower_run_fails_only_beyond_the_tolerance():
    kwargs = dict(metrics=["iteration-time"], allow_nondeterministic=False)
    beyond = compare.compare_metrics({"iteration-time": _steady(0.100)}, {"iteration-time": _steady(0.106)}, **kwargs)
    assert not beyond[0].passed and "slower by 6.0% (a regression beyond the tolerance)" in beyond[0].message
    within = compare.compare_metrics({"iteration-time": _steady(0.100)}, {"iteration-time": _steady(0.104)}, **kwargs)
    assert within[0].passed and "slower by 4.0%" in within[0].message and "regression" not in within[0].message
    same = compare.compare_metrics({"iteration-time": _steady(0.100)}, {"iteration-time": _steady(0.100)}, **kwargs)
    assert same[0].passed and same[0].message.endswith("(rtol 0.05)"), same[0].message


@pytest.mark.parametrize("metric", ["mem-allocated-bytes", "mem-max-allocated-bytes"])
def test_smaller_memory_passes_and_larger_memory_fails(metric):
    gib = 2.0 ** 30
    kwargs = dict(metrics=[metric], allow_nondeterministic=False)
    smaller = compare.compare_metrics({metric: _steady(4 * gib)}, {metric: _steady(3 * gib)}, **kwargs)
    assert smaller[0].passed and "smaller by 25.0% (an improvement)" in smaller[0].message, smaller[0].message
    larger = compare.compare_metrics({metric: _steady(4 * gib)}, {metric: _steady(4.4 * gib)}, **kwargs)
    assert not larger[0].passed and "larger by 10.0% (a regression beyond the tolerance)" in larger[0].message


def test_loss_checks_stay_two_sided():
    """A loss far below the golden one is as wrong as one far above it (unlike time and memory)."""
    lower = {"lm loss": golden({s: v * 0.9 for s, v in losses().items()})}
    for check in (compare.compare_metrics({"lm loss": golden(losses())}, lower, ["lm loss"], True),
                  compare.compare_metrics(lower, {"lm loss": golden(losses())}, ["lm loss"], True)):
        assert [r.passed for r in check] == [True, False], check
    zeros = {s: 100.0 for s in range(1, 11)}
    fewer = {s: 75.0 for s in range(1, 11)}
    assert failed(compare.compare_metrics({"num-zeros": golden(zeros)}, {"num-zeros": golden(fewer)},
                                          ["num-zeros"], allow_nondeterministic=True))


def test_missing_metric_or_step_fails_never_skips():
    values = {"lm loss": golden(losses(10))}
    assert failed(compare.compare_metrics(values, {}, ["lm loss"], allow_nondeterministic=True))
    assert failed(compare.compare_metrics({}, values, ["lm loss"], allow_nondeterministic=True))
    short = {"lm loss": golden(losses(8))}
    result = failed(compare.compare_metrics(values, short, ["lm loss"], allow_nondeterministic=True))
    assert result and "lacks 2 golden steps" in result[0].message
    assert failed(compare.compare_metrics(values, values, ["no such metric"], allow_nondeterministic=True))


def test_nan_loss_fails_unless_golden_is_nan():
    base = losses(10)
    with_nan = {**base, 5: math.nan}
    kwargs = dict(metrics=["lm loss"], allow_nondeterministic=False)
    assert failed(compare.compare_metrics({"lm loss": golden(base)}, {"lm loss": golden(with_nan)}, **kwargs))
    assert not failed(compare.compare_metrics({"lm loss": golden(with_nan)}, {"lm loss": golden(with_nan)}, **kwargs))


def test_a_nan_against_a_number_fails_the_approximate_check_too():
    """With the exact check informational (nondeterminism allowed), the rtol check alone must see a NaN:
    2 of 10 steps NaN is beyond the allowance of 1 step; NaN against NaN is equal."""
    base = losses(10)
    with_nan = {**base, 4: math.nan, 5: math.nan}
    kwargs = dict(metrics=["lm loss"], allow_nondeterministic=True)
    results = compare.compare_metrics({"lm loss": golden(base)}, {"lm loss": golden(with_nan)}, **kwargs)
    assert [r.message.split(";")[0] for r in failed(results)] == ["2 of 10 steps differ (allowed 1)"]
    assert not failed(compare.compare_metrics({"lm loss": golden(with_nan)}, {"lm loss": golden(with_nan)}, **kwargs))


def test_steady_window_skips_two_startup_steps_and_includes_its_last_step():
    """Six steps: len // 4 = 1, so at least 2 startup steps are skipped: window 3..6. The median is
    taken over the window's steps inclusive of its end: 3, 4, 5, 6 -> (1.0 + 1.08) / 2 = 1.04 when
    only the last two steps are slower, inside rtol 0.05 of golden 1.0 (steps 3-5 alone would give
    1.0; a window from step 2 would take in a startup step and give 1.08, failing)."""
    assert compare.default_steady_window([1, 2, 3, 4, 5, 6]) == (3, 6)
    assert compare.default_steady_window(list(range(1, 9))) == (3, 8)
    golden_time = {s: 1.0 for s in range(1, 7)}
    actual_time = {**golden_time, 1: 9.0, 2: 9.0, 5: 1.08, 6: 1.08}  # steps 1-2: startup
    result, = compare.compare_metrics({"iteration-time": golden(golden_time)},
                                      {"iteration-time": golden(actual_time)}, ["iteration-time"], False)
    assert result.passed and result.message.startswith("median over steps 3..6: actual 1.04 vs golden 1 ")


def test_a_time_or_memory_regression_from_a_zero_golden_value_fails_with_a_message():
    """A zero golden value (e.g. no memory allocated on a CPU run) and a larger actual value: a failing
    result, not a division by zero while writing the percentage."""
    zeros = {s: 0.0 for s in range(1, 9)}
    result, = compare.compare_metrics({"mem-allocated-bytes": golden(zeros)},
                                      {"mem-allocated-bytes": golden({s: 5.0 for s in zeros})},
                                      ["mem-allocated-bytes"], False)
    assert not result.passed and result.message == "median over steps 3..8: actual 5 vs golden 0 (rtol 0.05)"


def test_golden_format_keeps_the_step_interval():
    assert compare.to_golden_format({2: 1.0, 4: 2.0, 6: 3.0}) == {
        "start_step": 2, "end_step": 6, "step_interval": 2, "values": {"2": 1.0, "4": 2.0, "6": 3.0}}
    assert compare.to_golden_format({7: 1.0})["step_interval"] == 1


def test_restrict_steps_keeps_the_resumed_part():
    values = {"lm loss": golden(losses(50))}
    resumed = compare.restrict_steps(values, 26)["lm loss"]
    assert (resumed["start_step"], resumed["end_step"], len(resumed["values"])) == (26, 50, 25)


H200_RUN_1 = {"lm loss": golden({25: 0.2418327, 26: 0.2502398, 27: 0.1761144, 28: 0.1448189}),
              "num-zeros": golden({25: 1.0, 26: 2.0, 27: 3.0, 28: 4.0})}


def test_resumed_run_is_compared_with_megatrons_restart_average_at_its_second_step():
    # The H200 ckpt-resume run: after the restart at 26, Megatron printed step 27 as the mean of
    # run 1's steps 26 and 27 (lm loss only); every other step reproduces run 1 exactly.
    resumed = {"lm loss": golden({26: 0.2502398, 27: 0.2131771, 28: 0.1448189}),
               "num-zeros": golden({26: 2.0, 27: 3.0, 28: 4.0})}
    results = compare.compare_resumed(H200_RUN_1, resumed, 26, ["lm loss", "num-zeros"], False)
    assert not failed(results) and any("mean of steps 26-27" in r.test for r in results)
    # one printed unit off at the averaged step (Megatron averages unrounded values): still a pass
    off_by_a_unit = {**resumed, "lm loss": golden({26: 0.2502398, 27: 0.2131772, 28: 0.1448189})}
    assert not failed(compare.compare_resumed(H200_RUN_1, off_by_a_unit, 26, ["lm loss"], False))
    # two printed units off is beyond the 1.5-unit allowance (mean 0.2131771, unit 1e-7)
    off_by_two = {**resumed, "lm loss": golden({26: 0.2502398, 27: 0.2131773, 28: 0.1448189})}
    assert failed(compare.compare_resumed(H200_RUN_1, off_by_two, 26, ["lm loss"], False))
    # a resumed run that really differs fails: at the averaged step, and at any other step
    wrong_mean = {"lm loss": golden({26: 0.2502398, 27: 0.1761144, 28: 0.1448189})}
    assert failed(compare.compare_resumed(H200_RUN_1, wrong_mean, 26, ["lm loss"], False))
    wrong_later = {"lm loss": golden({26: 0.2502398, 27: 0.2131771, 28: 0.1448190})}
    assert failed(compare.compare_resumed(H200_RUN_1, wrong_later, 26, ["lm loss"], False))
    missing = {"lm loss": golden({26: 0.2502398, 28: 0.1448189})}
    assert failed(compare.compare_resumed(H200_RUN_1, missing, 26, ["lm loss"], False))


def test_printed_unit_is_the_last_of_seven_digits():
    assert compare._printed_unit(0.2131771) == pytest.approx(1e-7)
    assert compare._printed_unit(10.57882) == pytest.approx(1e-5)
    assert compare._printed_unit(0.0) == 0.0 and compare._printed_unit(float("nan")) == 0.0


def test_megatron_training_log_still_skips_the_first_reset():
    """compare_resumed models this line of megatron.training 0.19.2; fail loudly if it changes."""
    import inspect

    from megatron.training import training

    source = inspect.getsource(training.training_log)
    assert "should_reset = not is_first_iteration" in source, (
        "megatron.training.training_log changed how it resets its loss accumulator after the first "
        "iteration; update megatron_ext/bench/functional/compare.py:compare_resumed")


# ---- logs -----------------------------------------------------------------------------------------

MEGATRON_LOG = (
    " [2026-11-29 10:00:00.000000] iteration        1/      50 | consumed samples:           32 | "
    "elapsed time per iteration (ms): 2500.5 | learning rate: 6.000000E-05 | global batch size:    32 | "
    "lm loss: 1.038945E+01 | load_balancing_loss: 1.010000E+00 | loss scale: 1.0 | grad norm: 3.142 | "
    "num zeros: 17 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
    "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1024.50 | max allocated: 2048.25 | "
    "reserved: 3000.00 | max reserved: 3000.00\n"
    "[Rank 1] (after 1 iterations) memory (MB) | allocated: 9999.00 | max allocated: 9999.00 | "
    "reserved: 3000.00 | max reserved: 3000.00\n"
    "[default0]: [2026-11-29 10:00:01.000000] iteration        2/      50 | consumed samples:           64 | "
    "elapsed time per iteration (ms): 98.0 | lm loss: 1.021000E+01 | loss scale: 1.0 | num zeros: 12 |\n"
)


def test_megatron_log_lines_become_metrics():
    series = log_metrics.parse_log(MEGATRON_LOG)
    assert series["lm loss"] == {1: 10.38945, 2: 10.21}
    assert series["num-zeros"] == {1: 17.0, 2: 12.0}
    assert series["iteration-time"] == {1: 2.5005, 2: 0.098}
    assert series["mem-allocated-bytes"] == {1: 1024.5 * 2 ** 20}  # lowest rank's line
    assert series["mem-max-allocated-bytes"] == {1: 2048.25 * 2 ** 20}


def test_log_lines_with_long_steps_open_last_fields_and_unreadable_values():
    """Step 120 (several digits); a last field without its closing bar; a value that is not a number
    is NaN at its step (a failing step, never a missing one); only the requested metrics come back."""
    text = (" iteration      120/     200 | elapsed time per iteration (ms): 50.0 | lm loss: 2.500000E+00 | "
            "num zeros: 7\n"
            " iteration      121/     200 | lm loss: nan-ish | num zeros: 8 |\n")
    series = log_metrics.parse_log(text)
    assert series["lm loss"][120] == 2.5 and math.isnan(series["lm loss"][121])
    assert series["num-zeros"] == {120: 7.0, 121: 8.0} and series["iteration-time"] == {120: 0.05}
    values = log_metrics.metrics_from_log(text, ["num-zeros"])
    assert values == {"num-zeros": {"start_step": 120, "end_step": 121, "step_interval": 1,
                                    "values": {"120": 7.0, "121": 8.0}}}


def test_cpu_job_lines_parse_like_megatrons():
    line = (" iteration        3/      10 | elapsed time per iteration (ms): 41.2 | lm loss: 3.460552E+00 | "
            "dropped routes: 0 | MoE host syncs: 0 |")
    values = log_metrics.metrics_from_log(line, ["lm loss", "iteration-time", "num-zeros"])
    assert values["lm loss"]["values"] == {"3": 3.460552}
    assert "num-zeros" not in values


# ---- case files and the runner --------------------------------------------------------------------

def test_yaml_subset_reader():
    text = """
# comment
ENV_VARS:
  A: 1  # trailing comment
  B: ":4096:8"
MODEL_ARGS:
  --lr: 3e-4
  --flag: true
  --off: false
  --path: ${CHECKPOINT_SAVE_PATH}/x
STEADY_WINDOW: [10, 50]
METRICS:
  - lm loss
  - "num-zeros"
TEST_TYPE: regular
"""
    parsed = case_config.load_yaml_subset(text)
    assert parsed == {"ENV_VARS": {"A": 1, "B": ":4096:8"},
                      "MODEL_ARGS": {"--lr": 3e-4, "--flag": True, "--off": False,
                                     "--path": "${CHECKPOINT_SAVE_PATH}/x"},
                      "STEADY_WINDOW": [10, 50], "METRICS": ["lm loss", "num-zeros"], "TEST_TYPE": "regular"}
    argv = case_config.model_args_to_argv(parsed["MODEL_ARGS"], {"CHECKPOINT_SAVE_PATH": "/ck"})
    assert argv == ["--lr", "0.0003", "--flag", "--path", "/ck/x"]
    with pytest.raises(ValueError, match="unknown placeholder"):
        case_config.model_args_to_argv({"--x": "${NOPE}"}, {})


def test_yaml_subset_reads_what_yaml_reads():
    """As PyYAML reads these: '#' starts a comment only after a blank; a signed integer stays an int;
    a '- item' list may sit at its key's indentation; a line indented under a scalar is an error, not
    dropped."""
    text = """
MODEL_ARGS:
  --tag: run#2  # the comment is after the blank
  --seed: -3
METRICS:
- lm loss
- num-zeros
TEST_TYPE: regular
"""
    parsed = case_config.load_yaml_subset(text)
    assert parsed == {"MODEL_ARGS": {"--tag": "run#2", "--seed": -3},
                      "METRICS": ["lm loss", "num-zeros"], "TEST_TYPE": "regular"}
    assert case_config.model_args_to_argv(parsed["MODEL_ARGS"], {}) == ["--tag", "run#2", "--seed", "-3"]
    with pytest.raises(ValueError, match="unexpected indentation at 'B: 2'"):
        case_config.load_yaml_subset("A: 1\n  B: 2\n")


def test_exact_checks_are_required_unless_the_case_allows_nondeterminism():
    case = case_config.FunctionalCase("gpt/x", "/nowhere", {})
    assert not case.allow_nondeterministic  # no ENV_VARS: deterministic
    case.config["ENV_VARS"] = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": 1}
    assert case.allow_nondeterministic


EXPECTED_CASES = {"gpt/tiny_moe_rowwise_cpu_ep2", "gpt/moe_rowwise_1gpu", "gpt/moe_rowwise_1gpu_ckpt_resume",
                  "gpt/moe_rowwise_ep8_folding"}


def test_every_case_loads_with_known_metrics():
    assert EXPECTED_CASES <= set(case_config.list_cases())
    for name in case_config.list_cases():
        case = case_config.FunctionalCase.load(name)
        assert set(case.config["METRICS"]) <= set(compare.CHECK_THRESHOLDS), name
        assert os.path.isfile(os.path.join(REPO_ROOT, case.config["SCRIPT"])), name
        if case.config["TEST_TYPE"] == "ckpt-resume":
            assert "RESUME_ARGS" in case.config and "RESUME_STEP" in case.config, name


def test_cpu_case_has_golden_values_in_megatrons_format():
    case = case_config.FunctionalCase.load("gpt/tiny_moe_rowwise_cpu_ep2")
    values = case.load_golden("cpu")
    entry = values["lm loss"]
    assert (entry["start_step"], entry["end_step"], entry["step_interval"]) == (1, 10, 1)
    assert list(entry["values"]) == [str(s) for s in range(1, 11)]
    assert "iteration-time" not in case.config["METRICS"], "iteration time is not compared on CPU"


GPU_CASES = ("gpt/moe_rowwise_1gpu", "gpt/moe_rowwise_1gpu_layer_graphs", "gpt/moe_rowwise_1gpu_ckpt_resume")


def _committed_platforms(case):
    return [p for p in case.platforms if case.load_golden(p) is not None]


def test_gpu_golden_values_cover_every_step_of_the_single_gpu_cases():
    regular_case = case_config.FunctionalCase.load("gpt/moe_rowwise_1gpu")
    platforms = _committed_platforms(regular_case)
    assert platforms, "the single-GPU case has golden values for none of its platforms"
    for platform in platforms:
        regular = regular_case.load_golden(platform)
        assert set(regular) == {"lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes",
                                "mem-max-allocated-bytes"}
        loss = compare.values_by_step(regular["lm loss"])
        assert sorted(loss) == list(range(1, 51)) and all(math.isfinite(v) for v in loss.values())
        assert loss[50] < 0.1 * loss[1], "the golden run's loss must fall"
    resume = case_config.FunctionalCase.load("gpt/moe_rowwise_1gpu_ckpt_resume")
    for platform in _committed_platforms(resume):
        first, second = resume.load_golden(platform), resume.load_golden(platform, second_run=True)
        assert sorted(compare.values_by_step(first["lm loss"])) == list(range(1, 51))
        assert sorted(compare.values_by_step(second["lm loss"])) == list(range(26, 51))
        # the resumed run's golden values reproduce run 1's from step 26 (restart average at 27)
        assert not failed(compare.compare_resumed(first, second, 26, ["lm loss", "num-zeros"], False))


def test_the_single_gpu_cases_golden_losses_agree_bitwise_on_each_platform():
    """Same model, data and seed: eager, whole-layer graphs and the ckpt-resume case's run 1 must
    have the same lm loss and num-zeros on every step (the exact checks rely on it)."""
    cases = [case_config.FunctionalCase.load(name) for name in GPU_CASES]
    for platform in cases[0].platforms:
        values = [case.load_golden(platform) for case in cases]
        present = [v for v in values if v is not None]
        for other in present[1:]:
            for metric in ("lm loss", "num-zeros"):
                assert other[metric] == present[0][metric], (platform, metric)


def test_a_run_uses_the_golden_values_of_the_visible_gpu():
    case = case_config.FunctionalCase.load("gpt/moe_rowwise_1gpu")
    assert case.platforms == ["h200", "h100"]
    assert case.platform_for("NVIDIA H100 80GB HBM3") == "h100"
    assert case.platform_for("NVIDIA H200") == "h200"
    assert case.platform_for("NVIDIA A100-SXM4-80GB") == "h200"  # none listed: the first
    assert case.platform_for(None) == "h200"
    several = case_config.FunctionalCase("gpt/x", "/nowhere", {"PLATFORM": ["h200x8", "h100x8"]})
    assert several.platform_for("NVIDIA H100 80GB HBM3") == "h100x8"
    assert case_config.FunctionalCase.load("gpt/moe_rowwise_ep8_folding").platform_for("NVIDIA H200") == "h200x8"
    assert case_config.FunctionalCase.load("gpt/tiny_moe_rowwise_cpu_ep2").platform_for("NVIDIA H100") == "cpu"
    assert case.golden_path("h100").endswith("moe_rowwise_1gpu/golden_values_dev_h100.json")


def test_runner_says_no_golden_values_yet_instead_of_passing(monkeypatch, tmp_path):
    cases = tmp_path / "cases"
    for name, extra in (("regular", ""), ("resume", "RESUME_STEP: 2\n")):
        case_dir = cases / "gpt" / name
        case_dir.mkdir(parents=True)
        test_type = "ckpt-resume" if name == "resume" else "regular"
        (case_dir / "model_config.yaml").write_text(
            f"SCRIPT: examples/pretrain_gpt.py\nTEST_TYPE: {test_type}\n{extra}NEEDS_GPUS: 1\nMETRICS:\n  - lm loss\n"
            f"MODEL_ARGS:\n  --log-interval: 1\n")
    monkeypatch.setattr(case_config, "TEST_CASES_DIR", str(cases))
    monkeypatch.setattr(case_run, "visible_gpus", lambda: 8)
    monkeypatch.setattr(case_run, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(case_run, "run_training", lambda *a, **k: pytest.fail("no training may start"))
    for name in ("gpt/regular", "gpt/resume"):
        outcome = case_run.run_case(name, str(tmp_path / "out"))
        assert outcome.code == case_run.NO_GOLDEN, outcome.summary
        assert "NO GOLDEN VALUES YET" in outcome.summary and f"--case {name} --generate" in outcome.summary
        assert not (tmp_path / "out").exists(), "no output may be written without golden values"
    # with run 1's golden values present, a ckpt-resume case still needs the second run's
    (cases / "gpt" / "resume" / "golden_values_dev_h200.json").write_text("{}")
    outcome = case_run.run_case("gpt/resume", str(tmp_path / "out"))
    assert outcome.code == case_run.NO_GOLDEN and "golden_values_dev_h200_2nd.json" in outcome.summary
    # a case listing several GPU platforms looks for the visible GPU's golden values
    listed = cases / "gpt" / "listed"
    listed.mkdir()
    (listed / "model_config.yaml").write_text((cases / "gpt" / "regular" / "model_config.yaml").read_text()
                                              + "PLATFORM: [h200, h100]\n")
    (listed / "golden_values_dev_h200.json").write_text("{}")
    monkeypatch.setattr(case_run, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    outcome = case_run.run_case("gpt/listed", str(tmp_path / "out"))
    assert outcome.code == case_run.NO_GOLDEN and "golden_values_dev_h100.json" in outcome.summary
    assert "on h100" in outcome.summary

def test_generate_writes_both_runs_of_a_ckpt_resume_case_for_the_visible_gpu(monkeypatch, tmp_path):
    """--generate on a ckpt-resume case: run 1's values and the resumed run's, each in its own
    file named for the visible GPU (training stubbed: each run's "log" is its name)."""
    case_dir = tmp_path / "cases" / "gpt" / "resume"
    case_dir.mkdir(parents=True)
    (case_dir / "model_config.yaml").write_text(
        "SCRIPT: examples/pretrain_gpt.py\nTEST_TYPE: ckpt-resume\nRESUME_STEP: 2\nNEEDS_GPUS: 1\n"
        "PLATFORM: [h200x8, h100x8]\nMETRICS:\n  - lm loss\nMODEL_ARGS:\n  --log-interval: 1\n"
        "RESUME_ARGS:\n  --ckpt-step: 2\n")
    runs = {"run_1st.log": {1: 3.0, 2: 2.0, 3: 1.0, 4: 0.5}, "run_2nd.log": {3: 1.0, 4: 0.25}}
    monkeypatch.setattr(case_config, "TEST_CASES_DIR", str(tmp_path / "cases"))
    monkeypatch.setattr(case_run, "visible_gpus", lambda: 8)
    monkeypatch.setattr(case_run, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(case_run, "run_training", lambda command, env, log_path, timeout_s: os.path.basename(log_path))
    monkeypatch.setattr(case_run, "metrics_from_log", lambda log, metrics: {
        "lm loss": compare.to_golden_format(runs[log])})
    case_run.run_case("gpt/resume", str(tmp_path / "out"), generate=True)
    case = case_config.FunctionalCase.load("gpt/resume")
    first, second = case.load_golden("h100x8"), case.load_golden("h100x8", second_run=True)
    assert compare.values_by_step(first["lm loss"]) == runs["run_1st.log"]
    assert compare.values_by_step(second["lm loss"]) == runs["run_2nd.log"]
    assert case.load_golden("h200x8") is None


def test_gpu_cases_skip_without_gpus(monkeypatch):
    monkeypatch.setattr(case_run, "visible_gpus", lambda: 0)
    assert case_run.run_case("gpt/moe_rowwise_1gpu").code == case_run.SKIPPED


def test_training_command_uses_the_launcher_for_torchrun_cases():
    case = case_config.FunctionalCase.load("gpt/moe_rowwise_ep8_folding")
    command = training.training_command(case, [], {"CHECKPOINT_SAVE_PATH": "/ck"})
    assert command[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", "-m"]
    assert command[7:9] == ["megatron_ext.launch", os.path.join(REPO_ROOT, "examples/pretrain_gpt.py")]


# ---- the GPU cases' and example scripts' flags, parsed on CPU by Megatron's parser + the hook ------

def _script_argv(path):
    out = subprocess.run(["bash", path], env={**os.environ, "PRINT_ONLY": "1"}, capture_output=True, text=True,
                         cwd=REPO_ROOT, check=True).stdout
    words = shlex.split(out)
    return words[words.index("examples/pretrain_gpt.py") + 1:]


def _case_argv(name):
    case = case_config.FunctionalCase.load(name)
    placeholders = dict.fromkeys(("OUTPUT_PATH", "CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH",
                                  "TENSORBOARD_PATH", "DATA_PATH"), "/tmp/x")
    return (case_config.model_args_to_argv(case.config["MODEL_ARGS"], placeholders)
            + case_config.model_args_to_argv(case.config.get("RESUME_ARGS") or {}, placeholders))


def _parse_with_hook(argv, monkeypatch):
    """Megatron's parse_args on `argv` with the launcher's hook installed (as pretrain_gpt.py sees it)."""
    from megatron.training import arguments

    from megatron_ext import launch, specs

    uninstall = launch.install()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    try:
        return arguments.parse_args()
    finally:
        uninstall()
        monkeypatch.setattr(specs, "_default_ext_config", None)


@pytest.mark.parametrize("source", ["examples/run_1gpu.sh", "examples/run_8gpu_folding.sh", "gpt/moe_rowwise_1gpu",
                                    "gpt/moe_rowwise_1gpu_ckpt_resume", "gpt/moe_rowwise_ep8_folding"])
def test_gpu_flags_parse_and_validate(source, monkeypatch):
    from megatron_ext import launch

    argv = _script_argv(os.path.join(REPO_ROOT, source)) if source.endswith(".sh") else _case_argv(source)
    args = _parse_with_hook(argv, monkeypatch)
    assert args.spec == launch.EXT_SPEC and args.moe_ext_dispatcher == "rowwise" and args.moe_ext_transport == "symm"
    assert args.train_iters >= 50 and args.log_interval == 1
    if "8gpu" in source or "ep8" in source:
        assert (args.tensor_model_parallel_size, args.expert_model_parallel_size,
                args.expert_tensor_parallel_size) == (2, 8, 1)


def test_runner_cli_lists_cases():
    result = subprocess.run([sys.executable, "tests/functional_tests/runner.py", "--list"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and set(result.stdout.split()) >= EXPECTED_CASES


def test_runner_cli_exits_with_the_case_runs_code(monkeypatch, capsys):
    monkeypatch.setattr(case_run, "visible_gpus", lambda: 0)
    assert runner.main(["--case", "gpt/moe_rowwise_1gpu"]) == case_run.SKIPPED == 3
    assert "SKIPPED gpt/moe_rowwise_1gpu: needs 1 GPU(s), 0 visible" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # no --case: a usage error naming the cases
        runner.main([])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "give --case" in error and all(case in error for case in EXPECTED_CASES), error


def test_a_case_rtol_override_widens_only_its_metric():
    times = {s: 0.44 for s in range(1, 21)}
    slower = {s: 0.44 * 1.10 for s in range(1, 21)}
    golden_values = {"iteration-time": golden(times), "mem-allocated-bytes": golden(times)}
    actual_values = {"iteration-time": golden(slower), "mem-allocated-bytes": golden(slower)}
    metrics = ["iteration-time", "mem-allocated-bytes"]
    default = compare.compare_metrics(golden_values, actual_values, metrics, allow_nondeterministic=False)
    assert [r.passed for r in default] == [False, False]
    widened = compare.compare_metrics(golden_values, actual_values, metrics, allow_nondeterministic=False,
                                      rtol_overrides={"iteration-time": 0.15})
    assert [r.passed for r in widened] == [True, False] and "rtol 0.15" in widened[0].message
    case = case_config.FunctionalCase.load("gpt/moe_rowwise_1gpu")
    assert case.rtol_overrides == {"iteration-time": 0.15}


def test_a_ckpt_resume_case_without_log_interval_1_is_rejected(tmp_path, monkeypatch):
    case_dir = tmp_path / "gpt" / "resume_bad"
    case_dir.mkdir(parents=True)
    (case_dir / "model_config.yaml").write_text(
        "SCRIPT: examples/pretrain_gpt.py\nTEST_TYPE: ckpt-resume\nRESUME_STEP: 2\nMETRICS:\n  - lm loss\n"
        "MODEL_ARGS:\n  --log-interval: 10\n")
    monkeypatch.setattr(case_config, "TEST_CASES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="needs '--log-interval: 1'"):
        case_config.FunctionalCase.load("gpt/resume_bad")


BENCH_TRAINING = runpy.run_path(os.path.join(REPO_ROOT, "tools", "bench_training.py"), run_name="tool")


@pytest.mark.parametrize("variant", sorted(BENCH_TRAINING["VARIANTS"]))
def test_bench_training_variants_parse_and_validate(variant, monkeypatch):
    """Each variant's flags, appended to the case's, pass Megatron's parser and our validation
    and select what the variant's name says."""
    from megatron_ext import launch

    argv = _case_argv("gpt/moe_rowwise_1gpu") + BENCH_TRAINING["VARIANTS"][variant] + ["--train-iters", "30"]
    args = _parse_with_hook(argv, monkeypatch)
    expected_spec = ["megatron.training.models.gpt", "default_layer_spec"] if variant == "megatron" else launch.EXT_SPEC
    assert args.spec == expected_spec and args.train_iters == 30
    assert args.moe_ext_dispatcher == ("megatron" if variant == "ext_experts" else "rowwise")
    assert args.moe_ext_dropless == (variant == "rowwise_dropless")
    assert args.moe_ext_cuda_graphs == (variant == "rowwise_graphs")
    assert args.moe_ext_ddp_buckets == (variant == "rowwise_ddp_buckets")


def test_train_variant_appends_flags_and_reads_the_log(monkeypatch, tmp_path):
    seen = {}

    def fake_training(command, env, log_path, timeout_s):
        seen.update(command=command, env=env, log_path=log_path, timeout_s=timeout_s)
        return MEGATRON_LOG

    (tmp_path / "checkpoints").mkdir()  # a stale checkpoint folder must not survive into the run
    monkeypatch.setattr(training, "run_training", fake_training)
    case = case_config.FunctionalCase.load("gpt/moe_rowwise_1gpu")
    values = training.train_variant(case, ["--moe-ext-dropless"], str(tmp_path), "dropless", ["lm loss", "num-zeros"])
    assert seen["command"][-1] == "--moe-ext-dropless" and "megatron_ext.launch" in seen["command"]
    assert seen["log_path"] == str(tmp_path / "dropless.log") and seen["timeout_s"] == 1200.0
    assert seen["env"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0" and not (tmp_path / "checkpoints").exists()
    assert values == log_metrics.metrics_from_log(MEGATRON_LOG, ["lm loss", "num-zeros"]) and "lm loss" in values


@pytest.mark.parametrize("overrides, match", [("  iteration-tim: 0.15\n", "must name one of METRICS"),
                                              ("  lm loss: -1\n", "positive rtol"),
                                              ("  lm loss: 0\n", "positive rtol")])
def test_rtol_overrides_are_validated(overrides, match, tmp_path, monkeypatch):
    case_dir = tmp_path / "gpt" / "bad_rtol"
    case_dir.mkdir(parents=True)
    (case_dir / "model_config.yaml").write_text(
        "SCRIPT: examples/pretrain_gpt.py\nTEST_TYPE: regular\nMETRICS:\n  - lm loss\n  - iteration-time\n"
        f"MODEL_ARGS:\n  --log-interval: 1\nRTOL_OVERRIDES:\n{overrides}")
    monkeypatch.setattr(case_config, "TEST_CASES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=match):
        case_config.FunctionalCase.load("gpt/bad_rtol")
