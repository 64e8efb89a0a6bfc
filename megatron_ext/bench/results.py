"""Benchmark results as JSON files: the measurements plus the environment they came from
(device, library versions, host, date), one file per run under bench/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

from megatron_ext.bench.repo_paths import RESULTS_DIR


def env_info() -> dict:
    """Device, library versions and date for a result file."""
    from importlib import metadata

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "triton": version("triton"),
        "megatron_core": version("megatron-core"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def add_results_dir_arg(parser) -> None:
    """Every tool's --results-dir: where its JSON goes. On the GPU machine pass the device tool's
    $OUT, so the run's own file comes back and nothing else (the tool returns at most 8 files)."""
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where the result JSON goes (default: bench/results)")


def new_result_path(name: str, results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """A fresh <results_dir>/<name>_<YYYYmmdd-HHMMSS>.json path (not yet written)."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = results_dir / f"{name}_{stamp}.json"
    suffix = 1
    while path.exists():  # two results within one second
        path = results_dir / f"{name}_{stamp}-{suffix}.json"
        suffix += 1
    return path


def write_result(name: str, payload: dict, results_dir: str | os.PathLike = RESULTS_DIR,
                 path: Path | None = None) -> Path:
    """Write {"name", "env", "result": payload} to `path` (rewritten in place: long tools save as they
    go) or to a fresh <results_dir>/<name>_<YYYYmmdd-HHMMSS>.json."""
    path = path or new_result_path(name, results_dir)
    path.write_text(json.dumps({"name": name, "env": env_info(), "result": payload}, indent=2) + "\n")
    return path
