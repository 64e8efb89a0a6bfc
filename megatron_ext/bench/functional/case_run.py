"""One functional test case run end to end: train, extract the metrics from the log, compare with
the golden values, and the verdict as an exit code (tests/functional_tests/runner.py is its CLI).

TEST_TYPE regular: one run, compared with golden_values_<env>_<platform>.json, where <platform> is the
case's PLATFORM entry naming the visible GPU (`FunctionalCase.platform_for`).
TEST_TYPE ckpt-resume: run 1 trains all steps and saves a checkpoint at RESUME_STEP; run 2 adds
RESUME_ARGS (load that checkpoint) and trains to the end. Run 1 is compared with the golden
values, run 2 with the "_2nd" golden values and with run 1 on the resumed steps.

Exit codes: 0 passed (or golden values written), 1 a check failed, 2 no golden values yet,
3 skipped (needs more GPUs than visible), 4 the training command failed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

from megatron_ext.bench.functional.case_config import FunctionalCase, model_args_to_argv
from megatron_ext.bench.functional.compare import CheckResult, compare_metrics, compare_resumed, restrict_steps
from megatron_ext.bench.functional.log_metrics import metrics_from_log
from megatron_ext.bench.functional.training import (TrainingFailed, environment, fresh_placeholders, run_training,
                                                     training_command)

PASSED, FAILED, NO_GOLDEN, SKIPPED, TRAINING_FAILED = 0, 1, 2, 3, 4
RUNNER_SCRIPT = "tests/functional_tests/runner.py"  # the CLI, relative to the repository root


@dataclass
class CaseOutcome:
    """What a case run produced: exit code, a one-paragraph summary, every check result."""

    code: int
    summary: str
    results: list[CheckResult] = field(default_factory=list)
    output_dir: str | None = None

    def report(self) -> str:
        lines = [str(result) for result in self.results]
        return "\n".join(lines + [self.summary])


def generate_command(case: FunctionalCase) -> str:
    return f"python {RUNNER_SCRIPT} --case {case.name} --generate"


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def gpu_name() -> str | None:
    """GPU 0's name as torch reports it ("NVIDIA H100 80GB HBM3"), None without one."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        return None


def _write_json(path: str, values: dict) -> None:
    with open(path, "w") as handle:
        json.dump(values, handle, indent=2)
        handle.write("\n")


def run_case(name: str, output_dir: str | None = None, generate: bool = False,
             data_path: str | None = None) -> CaseOutcome:
    """Run one case end to end (see the module docstring); never raises for a failed check."""
    case = FunctionalCase.load(name)
    needed = int(case.config.get("NEEDS_GPUS", 0))
    if needed and visible_gpus() < needed:
        return CaseOutcome(SKIPPED, f"SKIPPED {case.name}: needs {needed} GPU(s), {visible_gpus()} visible")
    platform = case.platform_for(gpu_name())
    golden = case.load_golden(platform)
    golden_2nd = case.load_golden(platform, second_run=True) if case.config["TEST_TYPE"] == "ckpt-resume" else {}
    if not generate and (golden is None or golden_2nd is None):
        missing = case.golden_path(platform, second_run=golden is not None)
        return CaseOutcome(NO_GOLDEN, f"NO GOLDEN VALUES YET for {case.name} on {platform} ({missing} is "
                                      f"missing): this is not a pass. Generate them on {platform} with:\n  "
                                      f"{generate_command(case)}")
    output_dir = output_dir or tempfile.mkdtemp(prefix=f"functional_{case.name.replace('/', '_')}_")
    os.makedirs(output_dir, exist_ok=True)
    placeholders = fresh_placeholders(output_dir, data_path)
    env = environment(case)
    timeout_s = float(case.config.get("TIMEOUT_S", 1800))
    metrics = list(case.config["METRICS"])
    try:
        log = run_training(training_command(case, [], placeholders), env, os.path.join(output_dir, "run_1st.log"),
                           timeout_s)
        actual = metrics_from_log(log, metrics)
        _write_json(os.path.join(output_dir, "values_1st.json"), actual)
        actual_2nd = None
        if case.config["TEST_TYPE"] == "ckpt-resume":
            resume_args = model_args_to_argv(case.config.get("RESUME_ARGS") or {}, placeholders)
            log_2nd = run_training(training_command(case, resume_args, placeholders), env,
                                   os.path.join(output_dir, "run_2nd.log"), timeout_s)
            actual_2nd = restrict_steps(metrics_from_log(log_2nd, metrics), int(case.config["RESUME_STEP"]) + 1)
            _write_json(os.path.join(output_dir, "values_2nd.json"), actual_2nd)
    except TrainingFailed as error:
        return CaseOutcome(TRAINING_FAILED, f"TRAINING FAILED for {case.name}: {error}", output_dir=output_dir)

    results = []
    if actual_2nd is not None:  # the resumed steps must reproduce run 1
        first_resumed = int(case.config["RESUME_STEP"]) + 1
        resumed_metrics = [m for m in metrics if m in ("lm loss", "num-zeros")]
        results += [CheckResult(r.metric, f"resume vs run 1, {r.test}", r.passed, r.message) for r in compare_resumed(
            actual, actual_2nd, first_resumed, resumed_metrics, case.allow_nondeterministic)]
    if generate:
        written = [case.golden_path(platform)]
        _write_json(written[0], actual)
        if actual_2nd is not None:
            written.append(case.golden_path(platform, second_run=True))
            _write_json(written[1], actual_2nd)
        failed = [r for r in results if not r.passed]
        return CaseOutcome(FAILED if failed else PASSED,
                           f"GOLDEN VALUES WRITTEN for {case.name}: {', '.join(written)}"
                           + ("; but the resumed run did not reproduce run 1" if failed else ""), results, output_dir)
    results += compare_metrics(golden, actual, metrics, case.allow_nondeterministic, case.steady_window,
                               case.rtol_overrides)
    if actual_2nd is not None:
        results += [CheckResult(r.metric, f"2nd run, {r.test}", r.passed, r.message) for r in compare_metrics(
            golden_2nd, actual_2nd, metrics, case.allow_nondeterministic, case.steady_window, case.rtol_overrides)]
    failed = [r for r in results if not r.passed]
    mode = "exact checks skipped (nondeterminism allowed)" if case.allow_nondeterministic else "exact checks on"
    verdict = f"FAILED {len(failed)} of {len(results)} checks" if failed else f"PASSED all {len(results)} checks"
    return CaseOutcome(FAILED if failed else PASSED, f"{verdict} for {case.name} on {platform} ({mode}); "
                                                     f"outputs in {output_dir}", results, output_dir)
