"""tools/mesh.py defaults the expert tensor-parallel size to 1 (what the rowwise layer needs) and says so."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mesh(*argv):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "mesh.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_etp_defaults_to_one_with_a_note():
    out = _mesh("--world", "16", "--tp", "2", "--ep", "8")
    assert "expert tensor parallel size 1" in out and "ETP = TP = 2" in out
    assert "experts    ETP 1 x EP 8 x EDP 2" in out, out[:600]


def test_explicit_etp_is_kept_without_a_note():
    out = _mesh("--world", "16", "--tp", "2", "--ep", "4", "--etp", "2")
    assert "expert tensor parallel size 1" not in out
