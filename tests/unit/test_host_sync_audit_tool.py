"""tools/host_sync_audit.py on CPU: finds Megatron's host reads, none in the rowwise layer."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_audit_tool_reports_sync_sites_per_layer():
    result = subprocess.run(
        [sys.executable, "tools/host_sync_audit.py", "--layers", "rowwise_torch,megatron_alltoall", "--tokens", "64",
         "--experts", "4", "--topk", "2", "--hidden", "32", "--ffn", "16", "--stacks", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("== ")]
    assert lines[0].startswith("== rowwise_torch: python sync sites 0"), lines
    megatron = int(lines[1].split("python sync sites ")[1].split(",")[0])
    assert megatron > 0 and "tolist" in result.stdout, result.stdout[-2000:]
