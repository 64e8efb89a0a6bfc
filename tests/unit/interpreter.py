"""Run a kernel-check script under Triton's interpreter in a subprocess.

TRITON_INTERPRET=1 must be set before triton is imported, and the test process has already
imported it (Megatron does), so the CPU kernel checks run as separate scripts.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_under_interpreter(script_name: str, timeout: float = 240) -> str:
    """Run tests/unit/<script_name>; assert it exits 0 and return its stdout."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "unit", script_name)],
                          env=dict(os.environ, TRITON_INTERPRET="1"), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    print(proc.stdout)
    assert proc.returncode == 0, f"interpreter run of {script_name} failed ({proc.returncode}):\n" \
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout
