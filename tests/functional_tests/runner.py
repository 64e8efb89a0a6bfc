"""Run one functional test case: train, extract the metrics from the log, compare with golden values.

    python tests/functional_tests/runner.py --list
    python tests/functional_tests/runner.py --case gpt/tiny_moe_rowwise_cpu_ep2
    python tests/functional_tests/runner.py --case gpt/moe_rowwise_1gpu --generate   # write golden values

TEST_TYPE regular: one run, compared with golden_values_<env>_<platform>.json.
TEST_TYPE ckpt-resume: run 1 trains all steps and saves a checkpoint at RESUME_STEP; run 2 adds
RESUME_ARGS (load that checkpoint) and trains to the end. Run 1 is compared with the golden
values, run 2 with the "_2nd" golden values and with run 1 on the resumed steps.

Exit codes: 0 passed (or golden values written), 1 a check failed, 2 no golden values yet,
3 skipped (needs more GPUs than visible), 4 the training command failed.
Outputs (logs, actual values as JSON) go to --output-dir (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests.functional_tests.case_config import FunctionalCase, list_cases, model_args_to_argv  # noqa: E402
from tests.functional_tests.compare import (  # noqa: E402
    CheckResult, compare_metrics, compare_resumed, restrict_steps)
from tests.functional_tests.log_metrics import metrics_from_log  # noqa: E402

PASSED, FAILED, NO_GOLDEN, SKIPPED, TRAINING_FAILED = 0, 1, 2, 3, 4


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


class TrainingFailed(RuntimeError):
    pass


def generate_command(case: FunctionalCase) -> str:
    return f"python tests/functional_tests/runner.py --case {case.name} --generate"


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def training_command(case: FunctionalCase, extra_args: list[str], placeholders: dict[str, str]) -> list[str]:
    script = os.path.join(REPO_ROOT, case.config["SCRIPT"])
    argv = model_args_to_argv(case.config["MODEL_ARGS"], placeholders) + extra_args
    launcher = case.config.get("LAUNCHER", "python")
    if launcher == "python":
        return [sys.executable, script, *argv]
    if launcher == "torchrun":
        nproc = str(case.config.get("NPROC_PER_NODE", 1))
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc,
                "-m", "megatron_ext.launch", script, *argv]
    raise ValueError(f"{case.name}: unknown LAUNCHER {launcher!r} (python, torchrun)")


def run_training(command: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> str:
    """Run `command` (own process group), save its output and echo the iteration lines; return the
    log text. TrainingFailed on a non-zero exit or after `timeout_s` (the whole group is killed)."""
    print("+ " + " ".join(command), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                if "iteration" in line or "error" in line.lower():
                    print(line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=5)
            raise TrainingFailed(f"training exceeded {timeout_s:.0f} s (killed); log: {log_path}") from None
        reader.join(timeout=30)
    with open(log_path) as log:
        text = log.read()
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise TrainingFailed(f"training exited with code {proc.returncode}; log: {log_path}\n{tail}")
    return text


def environment(case: FunctionalCase) -> dict[str, str]:
    env = dict(os.environ)
    env.update(case.env_vars)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _write_json(path: str, values: dict) -> None:
    with open(path, "w") as handle:
        json.dump(values, handle, indent=2)
        handle.write("\n")


def fresh_placeholders(output_dir: str, data_path: str | None = None) -> dict[str, str]:
    """The ${...} values a case's MODEL_ARGS may use, under `output_dir`; clears old checkpoints
    there so that a run never resumes from a previous one by accident."""
    checkpoints = os.path.join(output_dir, "checkpoints")
    shutil.rmtree(checkpoints, ignore_errors=True)
    return {"OUTPUT_PATH": output_dir, "CHECKPOINT_SAVE_PATH": checkpoints, "CHECKPOINT_LOAD_PATH": checkpoints,
            "TENSORBOARD_PATH": os.path.join(output_dir, "tensorboard"),
            "DATA_PATH": data_path or os.environ.get("DATA_PATH", "")}


def train_variant(case: FunctionalCase, extra_args: list[str], output_dir: str, label: str,
                  metrics: list[str], data_path: str | None = None) -> dict:
    """Train `case` once with `extra_args` appended (later flags win in Megatron's parser); return
    the metrics from its log (saved as <output_dir>/<label>.log). Used by the tools that compare
    variants of one case (tools/mxfp8_loss_curve.py, tools/bench_training.py)."""
    log = run_training(training_command(case, extra_args, fresh_placeholders(output_dir, data_path)),
                       environment(case), os.path.join(output_dir, f"{label}.log"),
                       float(case.config.get("TIMEOUT_S", 1800)))
    return metrics_from_log(log, metrics)


def run_case(name: str, output_dir: str | None = None, generate: bool = False,
             data_path: str | None = None) -> CaseOutcome:
    """Run one case end to end (see the module docstring); never raises for a failed check."""
    case = FunctionalCase.load(name)
    needed = int(case.config.get("NEEDS_GPUS", 0))
    if needed and visible_gpus() < needed:
        return CaseOutcome(SKIPPED, f"SKIPPED {case.name}: needs {needed} GPU(s), {visible_gpus()} visible")
    golden = case.load_golden()
    golden_2nd = case.load_golden(second_run=True) if case.config["TEST_TYPE"] == "ckpt-resume" else {}
    if not generate and (golden is None or golden_2nd is None):
        missing = case.golden_path(second_run=golden is not None)
        return CaseOutcome(NO_GOLDEN, f"NO GOLDEN VALUES YET for {case.name} on {case.platform} ({missing} is "
                                      f"missing): this is not a pass. Generate them on {case.platform} with:\n  "
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
        _write_json(case.golden_path(), actual)
        written = [case.golden_path()]
        if actual_2nd is not None:
            _write_json(case.golden_path(second_run=True), actual_2nd)
            written.append(case.golden_path(second_run=True))
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
    return CaseOutcome(FAILED if failed else PASSED, f"{verdict} for {case.name} on {case.platform} ({mode}); "
                                                     f"outputs in {output_dir}", results, output_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help="<model>/<name> under tests/functional_tests/test_cases")
    parser.add_argument("--list", action="store_true", help="list the cases")
    parser.add_argument("--generate", action="store_true", help="write the golden values from this run")
    parser.add_argument("--output-dir", help="logs and actual values (default: a new temporary folder)")
    parser.add_argument("--data-path", help="fills ${DATA_PATH} (default: the DATA_PATH environment variable)")
    options = parser.parse_args(argv)
    if options.list or not options.case:
        print("\n".join(list_cases()))
        return 0 if options.list else 2
    outcome = run_case(options.case, options.output_dir, options.generate, options.data_path)
    print(outcome.report(), flush=True)
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
