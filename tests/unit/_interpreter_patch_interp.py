"""tests/unit/interpreter.patch_lang_once_per_kernel against Triton's own interpreter behaviour.

    TRITON_INTERPRET=1 python tests/unit/_interpreter_patch_interp.py

Checks: kernels with nested jit helpers compute as without the wrapper, and the helpers' re-patches
are skipped (fewer calls of Triton's patch than without it); a jit function called outside any
launch, then kernels whose modules see other language modules (triton.language.core only), still
run patched on every launch; fix_interpreter_bf16_cast rounds fp32 -> bf16 in kernels as torch
(and a GPU) does: to nearest, ties to even, NaN, infinities and overflow included. Exits 0 when
every check passes.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def _quadruple_kernel(src, dst, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(dst + offsets, _double(_double(tl.load(src + offsets))))


@triton.jit
def _plus_one(a):
    return a + 1


@triton.jit
def _to_bf16_kernel(src, dst, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(dst + offsets, tl.load(src + offsets).to(tl.bfloat16))


def check_bf16_cast() -> None:
    from tests.unit.interpreter import fix_interpreter_bf16_cast

    half_step = 2.0 ** -8  # half a bf16 step at 1.0
    values = torch.tensor([1 + half_step, 1 + 3 * half_step, 1 + half_step + 2 ** -20, 1 + half_step - 2 ** -20,
                           -(1 + 3 * half_step), 0.3, 1 / 3, 3.3e38, -3.4e38, float("inf"), float("-inf"),
                           float("nan"), 1e-40, 0.0, -0.0], dtype=torch.float32)
    out = torch.empty(16, dtype=torch.bfloat16)
    src = torch.cat([values, torch.zeros(1)])
    _to_bf16_kernel[(1,)](src, out, N=16)
    truncated = int((out[:15].float() != values.bfloat16().float()).sum())  # Triton's own cast: it truncates
    fix_interpreter_bf16_cast()
    _to_bf16_kernel[(1,)](src, out, N=16)
    want = values.bfloat16()
    assert torch.equal(out[:15].view(torch.int16), want.view(torch.int16)), (out[:15].tolist(), want.tolist())
    print(f"ok bf16 cast rounds as torch does (Triton's own cast differed in {truncated} of 15)")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 in the environment before running this script", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from triton.runtime import interpreter

    from tests.unit._jit_core_only import add_one_kernel
    from tests.unit.interpreter import patch_lang_once_per_kernel

    calls = []
    triton_patch = interpreter._patch_lang

    def counted(fn):
        calls.append(fn.__name__)
        return triton_patch(fn)
    interpreter._patch_lang = counted
    patch_lang_once_per_kernel()

    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    for launch in range(3):
        _quadruple_kernel[(1,)](src, dst, N=8)
        assert torch.equal(dst, src * 4), (launch, dst)
    assert calls == ["_quadruple_kernel"] * 3, calls  # without the wrapper: the helper's two calls each launch too
    print("ok nested helpers patched once per launch")

    assert _plus_one(1) == 2  # a jit call outside any launch patches as Triton does, and is never undone
    one, out = torch.ones(1), torch.zeros(1)
    for launch in range(3):
        out.zero_()
        add_one_kernel[(1,)](one, out)
        assert out.item() == 2.0, (launch, out)
    print("ok launches after a jit call outside a launch, on triton.language.core alone")
    check_bf16_cast()
    return 0


if __name__ == "__main__":
    sys.exit(main())
