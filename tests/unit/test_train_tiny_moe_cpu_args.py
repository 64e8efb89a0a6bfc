"""examples/train_tiny_moe_cpu.py refuses bad flags with a usage error (exit code 2, one line
saying what is wrong and what to do) before any rank starts, not with a traceback."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "examples", "train_tiny_moe_cpu.py")


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "error: --steps must be >= 2 (the job checks that the loss falls after the first step), got 0"),
    (["--steps", "1"], "error: --steps must be >= 2"),
    (["--ranks", "0"], "error: --ranks must divide the tiny model's 4 experts (EP equals --ranks), got 0; "
                       "use one of 1, 2, 4"),
    (["--ranks", "3"], "error: --ranks must divide the tiny model's 4 experts (EP equals --ranks), got 3; "
                       "use one of 1, 2, 4"),
    (["--capacity-factor", "0"], "error: --capacity-factor must be a finite number > 0, got 0.0; "
                                 "use e.g. 1.25, or --dropless to never drop routes"),
    (["--capacity-factor", "nan"], "error: --capacity-factor must be a finite number > 0, got nan"),
    (["--dropless", "--megatron-baseline"],
     "error: argument --megatron-baseline: not allowed with argument --dropless"),
], ids=["steps0", "steps1", "ranks0", "ranks3", "cf0", "cf_nan", "dropless_baseline"])
def test_bad_flags_give_a_usage_error(flags, message):
    result = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == "", "no rank may start"
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
