"""Golden-value comparison with Megatron-LM's functional-test tolerances (pure Python, no torch).

Values use Megatron's golden-value format, one entry per metric:

    {"lm loss": {"start_step": 1, "end_step": 50, "step_interval": 1, "values": {"1": 10.84, ...}}}

Checks per metric, as in Megatron-LM's tests/functional_tests/python_test_utils (CHECK_THRESHOLDS):
  * lm loss:   exact per step (skipped when the case allows nondeterminism) and rtol 0.05
  * num-zeros: exact per step (same rule) and rtol 0.20
  * iteration-time, mem-allocated-bytes, mem-max-allocated-bytes: rtol 0.05 on the median over
    a steady window (startup steps excluded); a case may override an rtol (RTOL_OVERRIDES).
    One-sided, unlike Megatron's: lower is better for time and memory, so only a slower or
    larger run beyond the tolerance fails (a regression); a faster or smaller one passes and its
    message says "faster by N%" / "smaller by N%" (an improvement: a run on a quicker machine
    of the same kind, or a change that saves time or memory, is not a failure)
Per-step approximate checks tolerate min(max(N // 100, 1), 50) failing steps out of N; the exact
check tolerates none. A metric missing on either side, or a step missing from the actual values,
is a failure, never a skip.
"""

from __future__ import annotations

import dataclasses
import math
import statistics


@dataclasses.dataclass(frozen=True)
class DeterministicTest:
    """Every step equal to the golden value (bitwise as logged)."""

    name: str = "deterministic"


@dataclasses.dataclass(frozen=True)
class LowerIsBetter:
    """A metric for which lower is better (time, memory), with the words for a lower and a
    higher value. Its approximate checks are one-sided: a regression (higher beyond the
    tolerance) fails, an improvement (lower, by any amount) passes and is reported."""

    lower: str  # "faster", "smaller"
    higher: str  # "slower", "larger"


FASTER = LowerIsBetter(lower="faster", higher="slower")
SMALLER = LowerIsBetter(lower="smaller", higher="larger")


@dataclasses.dataclass(frozen=True)
class ApproximateTest:
    """|actual - golden| <= atol + rtol * |golden|, per step or on the steady-window median;
    with `lower_is_better`, only actual - golden is bounded (regressions fail, improvements pass)."""

    rtol: float
    atol: float = 0.0
    steady_window_median: bool = False
    lower_is_better: LowerIsBetter | None = None

    @property
    def name(self) -> str:
        details = [f"rtol {self.rtol}"]
        if self.steady_window_median:
            details.append("steady-window median")
        if self.lower_is_better:
            details.append(f"fails only when {self.lower_is_better.higher}")
        return f"approximate ({', '.join(details)})"


CHECK_THRESHOLDS = {
    "lm loss": (DeterministicTest(), ApproximateTest(rtol=0.05)),
    "num-zeros": (DeterministicTest(), ApproximateTest(rtol=0.20)),
    "iteration-time": (ApproximateTest(rtol=0.05, steady_window_median=True, lower_is_better=FASTER),),
    "mem-allocated-bytes": (ApproximateTest(rtol=0.05, steady_window_median=True, lower_is_better=SMALLER),),
    "mem-max-allocated-bytes": (ApproximateTest(rtol=0.05, steady_window_median=True, lower_is_better=SMALLER),),
}


INFORMATIONAL_EXACT = "deterministic (informational: the case allows nondeterminism)"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    metric: str
    test: str
    passed: bool
    message: str

    def __str__(self) -> str:
        return f"[{'PASS' if self.passed else 'FAIL'}] {self.metric}: {self.test}: {self.message}"


def allowed_failing_steps(num_steps: int) -> int:
    """Megatron's allowance for approximate per-step checks: min(max(N // 100, 1), 50)."""
    return min(max(num_steps // 100, 1), 50)


def default_steady_window(steps: list[int]) -> tuple[int, int]:
    """Steps after the first quarter of the run (at least the first 2 steps are startup)."""
    skip = max(2, len(steps) // 4)
    kept = steps[skip:] or steps[-1:]
    return kept[0], kept[-1]


def values_by_step(entry: dict) -> dict[int, float]:
    """{"values": {"1": v, ...}} -> {1: v, ...} (steps as ints, values as floats, NaN kept)."""
    return {int(step): float(value) for step, value in entry["values"].items()}


def to_golden_format(series: dict[int, float]) -> dict:
    """{step: value} -> Megatron's golden-value entry."""
    steps = sorted(series)
    interval = steps[1] - steps[0] if len(steps) > 1 else 1
    return {"start_step": steps[0], "end_step": steps[-1], "step_interval": interval,
            "values": {str(step): series[step] for step in steps}}


def _close(actual: float, golden: float, test: ApproximateTest) -> bool:
    """Within the tolerance; for a lower-is-better metric, any value below the golden one is."""
    if math.isnan(golden) or math.isnan(actual):
        return math.isnan(golden) and math.isnan(actual)
    difference = actual - golden if test.lower_is_better else abs(actual - golden)
    return difference <= test.atol + test.rtol * abs(golden)


def _direction_note(actual: float, golden: float, words: LowerIsBetter, passed: bool) -> str:
    """How a lower-is-better value moved against the golden one, in percent of the golden value."""
    if not golden or math.isnan(actual) or math.isnan(golden) or actual == golden:
        return ""
    change = 100.0 * abs(actual - golden) / abs(golden)
    if actual < golden:
        return f"; {words.lower} by {change:.1f}% (an improvement)"
    return f"; {words.higher} by {change:.1f}%" + ("" if passed else " (a regression beyond the tolerance)")


def _equal(actual: float, golden: float) -> bool:
    return actual == golden or (math.isnan(actual) and math.isnan(golden))


def _check_per_step(metric, test, golden, actual, steps) -> CheckResult:
    if isinstance(test, DeterministicTest):
        bad = [s for s in steps if not _equal(actual[s], golden[s])]
        allowed = 0
    else:
        bad = [s for s in steps if not _close(actual[s], golden[s], test)]
        allowed = allowed_failing_steps(len(steps))
    shown = ", ".join(f"step {s}: actual {actual[s]!r} vs golden {golden[s]!r}" for s in bad[:5])
    if len(bad) > allowed:
        return CheckResult(metric, test.name, False,
                           f"{len(bad)} of {len(steps)} steps differ (allowed {allowed}); {shown}")
    note = f"; tolerated: {shown}" if bad else ""
    return CheckResult(metric, test.name, True, f"{len(steps)} steps, {len(bad)} differ (allowed {allowed}){note}")


def _check_steady_median(metric, test, golden, actual, steps, window) -> CheckResult:
    start, end = window or default_steady_window(steps)
    in_window = [s for s in steps if start <= s <= end]
    if not in_window:
        return CheckResult(metric, test.name, False, f"no golden steps inside the steady window {start}..{end}")
    golden_median = statistics.median(golden[s] for s in in_window)
    actual_median = statistics.median(actual[s] for s in in_window)
    ok = _close(actual_median, golden_median, test)
    note = _direction_note(actual_median, golden_median, test.lower_is_better, ok) if test.lower_is_better else ""
    return CheckResult(metric, test.name, ok, f"median over steps {start}..{end}: actual {actual_median:.6g} vs "
                                              f"golden {golden_median:.6g} (rtol {test.rtol}){note}")


def compare_metrics(golden: dict, actual: dict, metrics: list[str], allow_nondeterministic: bool,
                    steady_window: tuple[int, int] | None = None,
                    rtol_overrides: dict[str, float] | None = None) -> list[CheckResult]:
    """Every check of every metric; the run passes when all results pass.

    golden, actual: Megatron's golden-value format. Steps compared: the golden steps (inside
    `steady_window` for steady-median checks). `allow_nondeterministic` turns the exact checks into
    an always-passing report of how many steps were bitwise equal (Megatron skips them when
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=1). `rtol_overrides` ({metric: rtol}) replaces the rtol of
    that metric's approximate checks (a case's RTOL_OVERRIDES).
    """
    results = []
    for metric in metrics:
        if metric not in CHECK_THRESHOLDS:
            results.append(CheckResult(metric, "config", False, f"no tolerance known for metric {metric!r}; known: "
                                                                f"{sorted(CHECK_THRESHOLDS)}"))
            continue
        if metric not in golden:
            results.append(CheckResult(metric, "golden", False, "the golden values lack this metric"))
            continue
        if metric not in actual:
            results.append(CheckResult(metric, "actual", False, "the run did not log this metric"))
            continue
        golden_series, actual_series = values_by_step(golden[metric]), values_by_step(actual[metric])
        steps = sorted(golden_series)
        missing = [s for s in steps if s not in actual_series]
        if missing:
            results.append(CheckResult(metric, "steps", False, f"the run lacks {len(missing)} golden steps "
                                                               f"(first: {missing[:5]})"))
            continue
        for test in CHECK_THRESHOLDS[metric]:
            if isinstance(test, ApproximateTest) and metric in (rtol_overrides or {}):
                test = dataclasses.replace(test, rtol=rtol_overrides[metric])
            if isinstance(test, DeterministicTest) and allow_nondeterministic:
                equal = sum(_equal(actual_series[s], golden_series[s]) for s in steps)
                results.append(CheckResult(metric, INFORMATIONAL_EXACT, True,
                                           f"{equal} of {len(steps)} steps bitwise equal (not required)"))
                continue
            if isinstance(test, ApproximateTest) and test.steady_window_median:
                results.append(_check_steady_median(metric, test, golden_series, actual_series, steps, steady_window))
            else:
                results.append(_check_per_step(metric, test, golden_series, actual_series, steps))
    return results


def restrict_steps(values: dict, first_step: int) -> dict:
    """The same metrics with only steps >= first_step (the resumed part of a ckpt-resume run)."""
    restricted = {}
    for metric, entry in values.items():
        series = {s: v for s, v in values_by_step(entry).items() if s >= first_step}
        if series:
            restricted[metric] = to_golden_format(series)
    return restricted


# Metrics Megatron averages over the log interval (training_log's total_loss_dict). Its
# "interval-time" timer is not reset after the first iteration either, but the resumed steps
# compare only lm loss and num-zeros (per-iteration counts), so the loss is the one to model.
AVERAGED_METRICS = ("lm loss",)


def _printed_unit(value: float) -> float:
    """One unit in the last of the 7 significant digits Megatron prints ({:.6E})."""
    return 10.0 ** (math.floor(math.log10(abs(value))) - 6) if value and math.isfinite(value) else 0.0


def _without_step(values: dict, step: int, metrics) -> dict:
    kept = dict(values)
    for metric in metrics:
        if metric in kept:
            series = {s: v for s, v in values_by_step(kept[metric]).items() if s != step}
            kept[metric] = to_golden_format(series) if series else {"values": {}}
    return kept


def compare_resumed(run_1: dict, resumed: dict, first_step: int, metrics: list[str],
                    allow_nondeterministic: bool) -> list[CheckResult]:
    """The resumed run (steps >= first_step) against run 1 on the same steps.

    megatron.training 0.19.2's `training_log` does not reset its loss accumulator after a run's
    first iteration (`should_reset = not is_first_iteration`), so with --log-interval 1 the second
    logged iteration of every run prints the mean of the first two: run 1 at step 2, the resumed
    run at `first_step + 1`. That step is left out of the per-step checks of the averaged metrics
    and checked on its own: it must equal the mean of run 1's two steps within one printed unit
    (Megatron averages the unrounded sum; run 1's printed values are rounded).
    """
    averaged_step = first_step + 1
    averaged = [m for m in AVERAGED_METRICS if m in metrics]
    run_1 = restrict_steps(run_1, first_step)
    results = compare_metrics(_without_step(run_1, averaged_step, averaged),
                              _without_step(resumed, averaged_step, averaged), metrics, allow_nondeterministic)
    for metric in averaged:
        expected_steps = values_by_step(run_1[metric]) if metric in run_1 else {}
        got_steps = values_by_step(resumed[metric]) if metric in resumed else {}
        test = f"step {averaged_step}, printed as the mean of steps {first_step}-{averaged_step} after the restart"
        if not {first_step, averaged_step} <= set(expected_steps) or averaged_step not in got_steps:
            results.append(CheckResult(metric, test, False, f"step {first_step} or {averaged_step} is missing"))
            continue
        first, second = expected_steps[first_step], expected_steps[averaged_step]
        expected, got = (first + second) / 2, got_steps[averaged_step]
        # two rounded inputs (half a unit each, in the larger one's decade) and a rounded output
        tolerance = 1.5 * _printed_unit(max(abs(first), abs(second), abs(expected)))
        results.append(CheckResult(metric, test, abs(got - expected) <= tolerance,
                                   f"actual {got!r} vs mean {expected:.7g} (allowed +-{tolerance:.1e})"))
    return results
