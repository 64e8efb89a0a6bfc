"""A kernel whose module sees only triton.language.core (for _interpreter_patch_interp.py)."""

import triton
from triton.language import core


@triton.jit
def add_one_kernel(src, dst):
    core.store(dst, core.load(src) + 1)
