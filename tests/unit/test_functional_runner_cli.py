"""The functional runner's command line: an unknown case is a one-line usage error, not a traceback."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unknown_case_is_a_usage_error():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "functional_tests", "runner.py"),
                           "--case", "gpt/nope"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: no test case 'gpt/nope'; known cases: " in proc.stderr and "gpt/moe_rowwise_1gpu" in proc.stderr
    assert "Traceback" not in proc.stderr
