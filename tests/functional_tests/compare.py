"""Golden-value comparison with Megatron-LM's functional-test tolerances (pure Python, no torch).

Values use Megatron's golden-value format, one entry per metric:

    {"lm loss": {"start_step": 1, "end_step": 50, "step_interval": 1, "values": {"1": 10.84, ...}}}

Checks per metric, as in Megatron-LM's tests/functional_tests/python_test_utils (CHECK_THRESHOLDS):
  * lm loss:   exact per step (skipped when the case allows nondeterminism) and rtol 0.05
  * num-zeros: exact per step (same rule) and rtol 0.20
  * iteration-time, mem-allocated-bytes, mem-max-allocated-bytes: rtol 0.05 on the median over
    a steady window (startup steps excluded); a case may override an rtol (RTOL_OVERRIDES)
Per-step approximate checks tolerate min(max(N // 100, 1), 50) failing steps out of N; the exact
check tolerates none. A metric missing on either side, or a step missing from the actual values,
is a failure, never a skip.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class DeterministicTest:
    """Every step equal to the golden value (bitwise as logged)."""

    name: str = "deterministic"


@dataclass(frozen=True)
class ApproximateTest:
    """|actual - golden| <= atol + rtol * |golden|, per step or on the steady-window median."""

    rtol: float
    atol: float = 0.0
    steady_window_median: bool = False

    @property
    def name(self) -> str:
        return f"approximate (rtol {self.rtol}{', steady-window median' if self.steady_window_median else ''})"


CHECK_THRESHOLDS = {
    "lm loss": (DeterministicTest(), ApproximateTest(rtol=0.05)),
    "num-zeros": (DeterministicTest(), ApproximateTest(rtol=0.20)),
    "iteration-time": (ApproximateTest(rtol=0.05, steady_window_median=True),),
    "mem-allocated-bytes": (ApproximateTest(rtol=0.05, steady_window_median=True),),
    "mem-max-allocated-bytes": (ApproximateTest(rtol=0.05, steady_window_median=True),),
}


INFORMATIONAL_EXACT = "deterministic (informational: the case allows nondeterminism)"


@dataclass(frozen=True)
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
    if math.isnan(golden) or math.isnan(actual):
        return math.isnan(golden) and math.isnan(actual)
    return abs(actual - golden) <= test.atol + test.rtol * abs(golden)


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
    return CheckResult(metric, test.name, ok, f"median over steps {start}..{end}: actual {actual_median:.6g} vs "
                                              f"golden {golden_median:.6g} (rtol {test.rtol})")


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


# Metrics Megatron averages over the log interval (training_log's total_loss_dict); num-zeros,
# iteration time and memory are per-iteration values and are not affected.
AVERAGED_METRICS = ("lm loss",)


def as_logged_after_restart(values: dict, first_step: int, log_interval: int) -> dict:
    """Run 1's values on the resumed steps as a run restarted at `first_step` logs them.

    megatron.training 0.19.2's `training_log` does not reset its loss accumulator after a run's
    first iteration (`should_reset = not is_first_iteration`), so with --log-interval 1 the second
    logged iteration of every run reports the mean of the first two. Run 1 shows it at step 2,
    the resumed run at `first_step + 1`: this applies the same averaging to run 1's series so
    that a resumed run that reproduces run 1 compares equal (to the printed 7 digits).
    """
    if log_interval != 1:
        raise ValueError(f"as_logged_after_restart models --log-interval 1 only (got {log_interval}); set "
                         f"--log-interval: 1 in the ckpt-resume case")
    restarted = restrict_steps(values, first_step)
    for metric in AVERAGED_METRICS:
        series = values_by_step(restarted[metric]) if metric in restarted else {}
        if first_step in series and first_step + 1 in series:
            series[first_step + 1] = float(f"{(series[first_step] + series[first_step + 1]) / 2:.6E}")
            restarted[metric] = to_golden_format(series)
    return restarted
