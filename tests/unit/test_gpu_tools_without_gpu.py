"""The GPU-only tools on a machine without a GPU: each exits at once with status 2 and one line
naming itself, before any work and without writing into bench/results/ (issue 19, item 11).
The EP tools check only when CUDA is asked for (--device cuda, their default)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_ext.bench import cuda_required
from megatron_ext.bench.repo_paths import RESULTS_DIR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU_ONLY_TOOLS = {  # tool -> (the arguments of a typical run, how its line names it)
    "bench_moe_layer.py": ([], "tools/bench_moe_layer.py"),
    "bench_graphs.py": ([], "tools/bench_graphs.py"),
    "bench_training.py": ([], "tools/bench_training.py"),
    "bench_experts.py": (["--shapes", "tiny"], "tools/bench_experts.py"),
    "mxfp8_loss_curve.py": ([], "tools/mxfp8_loss_curve.py"),
    "bench_ep.py": ([], "tools/bench_ep.py --device cuda"),  # --device cuda is the default
    "bench_transport.py": (["--device", "cuda"], "tools/bench_transport.py --device cuda"),
    "bench_dropless_arena.py": ([], "tools/bench_dropless_arena.py"),
    "bench_host_trees.py": (["--baseline", "HEAD"], "tools/bench_host_trees.py"),
    "bench_wgrad.py": ([], "tools/bench_wgrad.py"),
}

no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the tools would run")


def _results_listing() -> set[str]:
    return set(os.listdir(RESULTS_DIR)) if RESULTS_DIR.is_dir() else set()


@no_gpu_here
@pytest.mark.parametrize("tool", sorted(GPU_ONLY_TOOLS))
def test_gpu_only_tool_exits_2_with_one_line_and_writes_nothing(tool):
    args, label = GPU_ONLY_TOOLS[tool]
    before = _results_listing()
    result = subprocess.run([sys.executable, os.path.join("tools", tool), *args], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert result.stderr.splitlines() == [
        f"{label} needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)"], result.stderr[-3000:]
    assert result.stdout == "", "no work may start before the check"
    assert _results_listing() == before, "nothing may be written into bench/results/"


def test_help_and_argument_errors_come_before_the_gpu_check():
    """--help documents a GPU tool on any machine; a wrong argument is reported as such."""
    helped = subprocess.run([sys.executable, "tools/bench_moe_layer.py", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--tokens" in helped.stdout, helped.stderr[-2000:]
    wrong = subprocess.run([sys.executable, "tools/bench_training.py", "--variants", "nope"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "unknown variants ['nope']" in wrong.stderr, wrong.stderr[-2000:]
    unprofiled = subprocess.run([sys.executable, "tools/bench_dropless_arena.py", "--paths", "per_layer,arena",
                                 "--profile", "per_layer,dropless"], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
    assert unprofiled.returncode == 2 and "--profile takes two of --paths (per_layer,arena)" in unprofiled.stderr, \
        unprofiled.stderr[-2000:]


def test_require_cuda_returns_with_a_gpu_and_exits_2_without(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_required.require_cuda("tools/x.py") is None
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cuda_required.require_cuda("tools/x.py")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("tools/x.py needs a CUDA GPU; none is visible "
                                       "(torch.cuda.is_available() is False)\n")


@no_gpu_here
def test_host_sync_audit_says_when_it_leaves_out_the_rowwise_symm_layer():
    small = ["--tokens", "64", "--experts", "4", "--topk", "2", "--hidden", "32", "--ffn", "16", "--stacks", "0"]
    alone = subprocess.run([sys.executable, "tools/host_sync_audit.py", "--layers", "rowwise_symm", *small], cwd=REPO,
                           capture_output=True, text=True, timeout=180)
    assert alone.returncode == 0, alone.stderr[-3000:]
    lines = alone.stdout.splitlines()
    assert lines[0] == ("no CUDA GPU visible: rowwise_symm left out (the symm transport needs a GPU); auditing "
                        "rowwise_torch (the same rowwise layer, torch transport) instead"), lines
    assert lines[1].startswith("== rowwise_torch: python sync sites 0"), lines


def test_host_sync_audit_layer_filter_without_a_gpu(capsys):
    import runpy

    tool = runpy.run_path(os.path.join(REPO, "tools", "host_sync_audit.py"), run_name="tool")
    assert tool["without_gpu_only_layers"](["rowwise_symm", "megatron_alltoall"]) == ["megatron_alltoall"]
    assert capsys.readouterr().out == ("no CUDA GPU visible: rowwise_symm left out (the symm transport needs a GPU); "
                                       "--layers rowwise_torch audits the same rowwise layer on CPU\n")
    assert tool["without_gpu_only_layers"](["rowwise_torch", "megatron_alltoall"]) == ["rowwise_torch",
                                                                                         "megatron_alltoall"]
    assert capsys.readouterr().out == "", "nothing left out: nothing to say"
