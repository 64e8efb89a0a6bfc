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


def fix_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.7) keeps bf16 values as their uint16 bit patterns and its tl.dot
    multiplies those patterns as integers. Upcast bf16 operands first, as a GPU's bf16 MMA does
    (exact products, fp32 sums). Harmless once the interpreter handles bf16 itself."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "upcasts_bf16", False):
        return
    create_dot = builder.create_dot

    def upcast_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    upcast_dot.upcasts_bf16 = True
    builder.create_dot = upcast_dot
