"""Run the Triton MXFP8 kernels under TRITON_INTERPRET=1 on CPU and compare bytes with torch.

Run as a subprocess by tests/unit/test_mxfp8.py (the interpreter flag must be set before
triton is first imported). Prints one line per check; exits 1 on the first mismatch.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import warnings  # noqa: E402

import torch  # noqa: E402

from megatron_ext.kernels import mxfp8_quant as kernels  # noqa: E402
from megatron_ext.formats import mxfp8  # noqa: E402
from mxfp8_spec_reference import make_spec_inputs, same_bits  # noqa: E402


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        sys.exit(1)


def check_quantize(name: str, x: torch.Tensor) -> None:
    want = mxfp8.quantize_rows(x)
    got = kernels.quantize_rows_triton(x)
    check(f"quantize values {name}", same_bits(got.values, want.values))
    check(f"quantize scales {name}", same_bits(got.scales, want.scales))
    for dtype in (torch.float32, torch.bfloat16):
        check(
            f"dequantize {dtype} {name}",
            same_bits(kernels.dequantize_rows_triton(want, dtype), mxfp8.dequantize_rows(want, dtype)),
        )


def main() -> None:
    # numpy warns on the fp32 overflow of 448 * 2^127 (scale byte 0xFE); inf is the right answer.
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
    torch.manual_seed(0)
    for name, x in make_spec_inputs(seed=1).items():
        check_quantize(name, x)
    # Into column slices of wider byte buffers holding 0xA5: the bytes around them stay untouched
    # (a row of 3 blocks runs in a tile of 4: the fourth is masked).
    x = torch.randn(7, 96) * 100
    values_buf = torch.full((7, 96 + 64), 0xA5, dtype=torch.uint8)
    scales_buf = torch.full((7, 3 + 4), 0xA5, dtype=torch.uint8)
    views = mxfp8.MXFP8Rows(values_buf[:, 32:128].view(mxfp8.VALUE_DTYPE), scales_buf[:, 2:5].view(mxfp8.SCALE_DTYPE))
    kernels.quantize_rows_triton(x, out=views)
    want = mxfp8.quantize_rows(x)
    check("quantize into views: bytes", same_bits(views.values, want.values) and same_bits(views.scales, want.scales))
    outside = torch.cat([values_buf[:, :32], values_buf[:, 128:], scales_buf[:, :2], scales_buf[:, 5:]], dim=1)
    check("quantize into views: nothing written outside them", bool((outside == 0xA5).all()))
    # Shapes: N not a multiple of the rows per program, blocks not a power of two, several
    # block tiles per row, and a strided (sliced) input.
    check_quantize("odd_shape", torch.randn(7, 96) * 100)
    check_quantize("multi_tile", torch.randn(5, 1088, dtype=torch.bfloat16))
    wide = torch.randn(6, 320)
    check_quantize("strided_rows", wide[:, 32:288])
    x = torch.randn(9, 2080, dtype=torch.bfloat16)  # 2080 + 65 = 2145 -> padded to 2160
    packed = kernels.quantize_rows_packed_triton(x)
    check("packed rows", same_bits(packed, mxfp8.pack_rows(mxfp8.quantize_rows(x))))
    views = mxfp8.unpack_rows(packed, 2080)
    check("dequantize from packed views",
          same_bits(kernels.dequantize_rows_triton(views), mxfp8.dequantize_rows(views)))
    # Every E4M3 code against every E8M0 byte (including 0x00, 0xFE and NaN 0xFF).
    codes = torch.arange(256, dtype=torch.uint8).repeat(32, 1)
    scales = (torch.arange(32 * 8).reshape(32, 8) % 256).to(torch.uint8)
    q = mxfp8.MXFP8Rows(codes.view(mxfp8.VALUE_DTYPE), scales.view(mxfp8.SCALE_DTYPE))
    for dtype in (torch.float32, torch.bfloat16):
        check(
            f"dequantize all codes x all scales {dtype}",
            same_bits(kernels.dequantize_rows_triton(q, dtype), mxfp8.dequantize_rows(q, dtype)),
        )
    print("all interpreter checks passed")


if __name__ == "__main__":
    main()
