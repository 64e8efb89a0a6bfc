"""Run a kernel-check script under Triton's interpreter in a subprocess.

TRITON_INTERPRET=1 must be set before triton is imported, and the test process has already
imported it (Megatron does), so the CPU kernel checks run as separate scripts. The longest scripts
split their cases into shards (`--shard K/N`, `shard` below) that `run_at_once` starts together:
the test process only waits, so CI's two cores run two shards in the time of one.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def report(cases: int, failures: list[str]) -> int:
    """A check script's last lines: the case and failure counts, each failure, and its exit code."""
    print(f"{cases} cases, {len(failures)} failures")
    for failure in failures:
        print(failure)
    return 1 if failures else 0


def run_under_interpreter(script_name: str, timeout: float = 240) -> str:
    """Run tests/unit/<script_name>; assert it exits 0 and return its stdout."""
    proc, = run_at_once([[script_name]], timeout)
    print(proc.stdout)
    assert proc.returncode == 0, f"interpreter run of {script_name} failed ({proc.returncode}):\n" \
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def run_at_once(runs: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start every run ([script name in tests/unit, *arguments]) under the interpreter at once and
    wait for all; their results in order, stdout and stderr as text."""
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "unit", script), *args],
                              env=dict(os.environ, TRITON_INTERPRET="1"), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for script, *args in runs]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def run_shards(script_name: str, *args: str, shards: int = 2, timeout: float = 300) -> tuple[int, str]:
    """Run a script's cases split into `shards` processes at once: the first failing shard's exit
    code (0 if none failed) and all the shards' stdout (printed, with their stderr, for the test's report)."""
    results = run_at_once([[script_name, *args, "--shard", f"{k}/{shards}"] for k in range(shards)], timeout)
    for result in results:
        print(result.stdout)
        print(result.stderr[-4000:])
    failed = [result.returncode for result in results if result.returncode != 0]
    return (failed[0] if failed else 0), "".join(result.stdout for result in results)


def shard(items, spec: str | None) -> list:
    """For the scripts: `spec` "K/N" keeps every Nth item from the Kth (0-based); None keeps all."""
    items = list(items)
    if spec is None:
        return items
    index, count = (int(part) for part in spec.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"--shard {spec!r}: want K/N with 0 <= K < N")
    return items[index::count]


def interpreter_ready() -> bool:
    """An interpreter script's first call (with the repository on sys.path): False, after saying so,
    unless TRITON_INTERPRET=1 is set; else Triton's per-helper re-patch is skipped
    (`patch_lang_once_per_kernel`), fp32 -> bf16 casts round as on a GPU (`fix_interpreter_bf16_cast`),
    and True."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 in the environment before running this script", file=sys.stderr)
        return False
    patch_lang_once_per_kernel()
    fix_interpreter_bf16_cast()
    return True


def patch_lang_once_per_kernel() -> None:
    """Triton's interpreter (3.7) patches triton.language again at every call of a @triton.jit
    helper inside a kernel (inspect.getmembers over the language modules: a quarter of the arena
    ordering script's time, two thirds of the route-plan script's) and never undoes those nested
    patches until the process ends. Inside one launch, a helper whose language modules that launch
    has already patched skips it; a launch, and any jit call outside one, patches as before.
    Harmless if the interpreter changes: then nothing is wrapped."""
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if (patch_lang is None or executor is None or not hasattr(interpreter, "_LangPatchScope")
            or getattr(patch_lang, "once_per_kernel", False)):
        return
    launches: list[set[int]] = []  # per running launch: the language modules patched since it began
    run_launch = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    @functools.cache
    def languages(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def patch_once(fn):
        needed = languages(fn)
        if launches and needed and needed <= launches[-1]:
            return interpreter._LangPatchScope()  # patched since this launch began: nothing to undo
        scope = patch_lang(fn)  # asserts, as before, that fn sees a language module
        if launches:
            launches[-1].update(needed)
        return scope

    patch_once.once_per_kernel = True
    executor.__call__ = launch
    interpreter._patch_lang = patch_once


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


def fix_interpreter_bf16_cast() -> None:
    """Triton's interpreter (3.7) casts fp32 to bf16 by truncation (no rounding mode reaches its
    float conversion); a GPU rounds to nearest even, as torch does. Cast through torch instead, so
    the interpreter rounds as the GPU kernels do and the checks can ask for GPU-tight tolerances."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_to_nearest_even", False):
        return
    cast_impl = builder.cast_impl

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.tensor(np.asarray(src.data, dtype=np.float32)).bfloat16()
            return interpreter.TensorHandle(values.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    rounding_cast.rounds_to_nearest_even = True
    builder.cast_impl = rounding_cast
