"""Training a functional-test case: its command line, environment and placeholders, the run
itself (output saved and echoed, killed on timeout), and the metrics read from its log.

Used by the case runner (case_run.run_case) and by the tools that train variants of one case
(tools/mxfp8_loss_curve.py, tools/bench_training.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

from megatron_ext.bench.functional.case_config import FunctionalCase, model_args_to_argv
from megatron_ext.bench.functional.log_metrics import metrics_from_log
from megatron_ext.bench.repo_paths import REPO_ROOT as _REPO_ROOT

REPO_ROOT = str(_REPO_ROOT)  # the training runs here; a case's SCRIPT is relative to it


class TrainingFailed(RuntimeError):
    """The training command exited with an error or ran past the case's TIMEOUT_S."""


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
    """This process's environment, the case's ENV_VARS, and the repository root on PYTHONPATH."""
    env = dict(os.environ)
    env.update(case.env_vars)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


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
