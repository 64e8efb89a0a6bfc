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
    (["--megatron-baseline", "--capacity-factor", "0.5"],
     "error: --capacity-factor sizes megatron_ext's dispatch buffers; --megatron-baseline runs Megatron's"),
], ids=["steps0", "steps1", "ranks0", "ranks3", "cf0", "cf_nan", "dropless_baseline", "cf_baseline"])
def test_bad_flags_give_a_usage_error(flags, message):
    result = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == "", "no rank may start"
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_an_arena_overflow_stops_the_job_with_its_message():
    """The dropless arena's default policy is an error: at capacity factor 1.0 the skewed first
    step overflows the budget and the job ends with the overflow's message (no traceback, no
    warnings of Megatron's fallbacks in the output)."""
    result = subprocess.run([sys.executable, SCRIPT, "--steps", "3", "--dropless-arena", "--capacity-factor", "1.0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("training stopped: megatron_ext bounded dropless: MoE layer"), result.stderr
    assert "dropless arena" in last and "overflow policy (error)" in last and "--moe-ext-dropless " not in last, last
    assert "--moe-ext-" not in last and "raise --capacity-factor" in last and "--dropless" in last, last  # its flags
    assert "Traceback" not in result.stderr and "Warning" not in result.stderr, result.stderr
    assert "step   1 |" in result.stdout and "step   3 |" not in result.stdout, result.stdout
