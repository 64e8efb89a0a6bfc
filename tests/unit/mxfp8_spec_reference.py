"""Slow MXFP8 reference written from the OCP MX v1.0 text with plain Python floats.

Independent of ``megatron_ext.formats.mxfp8``: no torch fp8 casts, no bit tricks on fp32. The E4M3
grid is built by enumerating every code from its definition (sign, 4-bit exponent with bias 7,
3-bit mantissa, subnormals at exponent 0, S.1111.111 = NaN), and rounding picks the nearest
grid value with ties going to the even code (mantissa LSB 0); the grid is sorted, so the two
candidates are found by bisection. Python floats are binary64, which holds every fp32/bf16 input
and every ``x / 2^X`` exactly, so no step here rounds except the one E4M3 rounding.

Also holds ``same_bits`` (byte equality where NaN payloads may differ) and ``make_spec_inputs``:
inputs that hit each clause of the spec (magnitudes, subnormals, zero blocks, saturation, ties,
powers of two, NaN/Inf), shared by the unit test and the Triton-interpreter script.
"""

from __future__ import annotations

import bisect
import math

import torch

BLOCK = 32
EMAX_ELEM = 8  # E4M3: largest normal exponent (448 = 1.75 * 2^8)
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F


def e4m3_decode(code: int) -> float:
    """Value of an E4M3 (fn) code, from the format's definition."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** (1 - 7)
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


# Non-negative finite grid: codes 0x00..0x7E, increasing in value.
_GRID_CODES = list(range(0x7F))
_GRID_VALUES = [e4m3_decode(c) for c in _GRID_CODES]
assert _GRID_VALUES == sorted(_GRID_VALUES) and _GRID_VALUES[-1] == 448.0
E4M3_MAX = _GRID_VALUES[-1]


def e4m3_round_magnitude(value: float) -> int:
    """Code of the nearest grid value to ``value >= 0`` (ties to even code), saturating at 448."""
    if value >= E4M3_MAX:
        return _GRID_CODES[-1]
    hi = bisect.bisect_left(_GRID_VALUES, value)
    if _GRID_VALUES[hi] == value:
        return _GRID_CODES[hi]
    lo = hi - 1
    below, above = value - _GRID_VALUES[lo], _GRID_VALUES[hi] - value
    if below < above:
        return _GRID_CODES[lo]
    if above < below:
        return _GRID_CODES[hi]
    return _GRID_CODES[lo] if _GRID_CODES[lo] % 2 == 0 else _GRID_CODES[hi]


def quantize_block(block: list[float]) -> tuple[int, list[int]]:
    """(E8M0 scale byte, 32 E4M3 codes) for one block, per the module docstring of mxfp8.py."""
    if any(not math.isfinite(v) for v in block):
        return E8M0_NAN, [E4M3_NAN] * len(block)
    amax = max(abs(v) for v in block)
    if amax == 0.0:
        shared_exp = -127  # documented choice: zero block -> smallest scale
    else:
        shared_exp = math.floor(math.log2(amax))
        # log2 of a float can be off by one ulp near powers of two: confirm with exact compares.
        while 2.0**shared_exp > amax:
            shared_exp -= 1
        while 2.0 ** (shared_exp + 1) <= amax:
            shared_exp += 1
        shared_exp -= EMAX_ELEM
    shared_exp = min(max(shared_exp, -127), 127)
    codes = []
    for v in block:
        code = e4m3_round_magnitude(abs(v) / 2.0**shared_exp)
        if math.copysign(1.0, v) < 0:
            code |= 0x80
        codes.append(code)
    return shared_exp + 127, codes


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 value codes [N, H] and uint8 scale bytes [N, H/32] for a [N, H] tensor."""
    rows = x.double().tolist()  # exact for fp32/bf16
    codes_out, scales_out = [], []
    for row in rows:
        row_codes, row_scales = [], []
        for start in range(0, len(row), BLOCK):
            scale, codes = quantize_block(row[start : start + BLOCK])
            row_scales.append(scale)
            row_codes.extend(codes)
        codes_out.append(row_codes)
        scales_out.append(row_scales)
    return torch.tensor(codes_out, dtype=torch.uint8), torch.tensor(scales_out, dtype=torch.uint8)


def dequantize_rows_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact float64 [N, H] values ``e4m3 * 2^(scale - 127)`` (NaN scale -> NaN block)."""
    out = []
    for row_codes, row_scales in zip(codes.tolist(), scales.tolist()):
        row = []
        for i, code in enumerate(row_codes):
            scale = row_scales[i // BLOCK]
            row.append(math.nan if scale == E8M0_NAN else e4m3_decode(code) * 2.0 ** (scale - 127))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of same-dtype tensors; float NaNs must coincide but their payload bits may
    differ (NaN payloads are not part of the format: torch and the kernels propagate different ones)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() and a.element_size() > 1:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def make_spec_inputs(seed: int = 0, hidden: int = 256) -> dict[str, torch.Tensor]:
    """Named [N, hidden] inputs covering each clause of the spec (fp32 unless named bf16)."""
    g = torch.Generator().manual_seed(seed)
    blocks = hidden // BLOCK

    def log_uniform(n, lo, hi):
        sign = torch.where(torch.rand(n, hidden, generator=g) < 0.5, -1.0, 1.0).double()
        exp = torch.empty(n, hidden, dtype=torch.float64).uniform_(lo, hi, generator=g)
        return sign * torch.exp2(exp)

    cases = {}
    # Whole rows at one magnitude each, 1e-30 .. 1e30, with +-2^5 spread inside every block.
    row_scale = torch.linspace(-99.0, 99.0, 24, dtype=torch.float64)[:, None]
    cases["magnitudes_fp32"] = (log_uniform(24, -5, 5) * torch.exp2(row_scale)).float()
    # Wide spread inside blocks: elements far below amax hit E4M3 subnormals and zero.
    cases["wide_blocks_fp32"] = log_uniform(16, -30, 10).float()
    cases["normal_bf16"] = torch.randn(16, hidden, generator=g).mul(3.0).to(torch.bfloat16)
    cases["magnitudes_bf16"] = (log_uniform(16, -5, 5) * torch.exp2(row_scale[::3][:8].repeat(2, 1))).to(
        torch.bfloat16
    )
    # fp32 subnormal inputs (< 2^-126): all-subnormal blocks (X clamps to -127) and mixes.
    sub = log_uniform(8, -149, -126).float()
    sub[4:, ::3] = log_uniform(4, -120, -100).float()[:, ::3]
    cases["subnormal_fp32"] = sub
    cases["subnormal_bf16"] = log_uniform(8, -133, -126).to(torch.bfloat16)

    # Hand-built blocks: each row is one theme, 2^k shifts the whole row (X = k when amax = 256*2^k).
    special = torch.zeros(8, hidden, dtype=torch.float64)
    k = torch.arange(hidden, dtype=torch.float64).remainder(40).sub(20)  # per-element shift source
    grid = torch.tensor([e4m3_decode(c) for c in range(0x7F)], dtype=torch.float64)
    idx = torch.randint(1, 0x7E, (8, hidden), generator=g)
    # row 0: exact E4M3 values times 2^X, amax pinned to 256 in every block -> exact round trip
    special[0] = grid[idx[0]]
    special[0, ::BLOCK] = 256.0
    # row 1: ties: midpoints between neighbouring grid values (round to even code)
    mid = (grid[idx[1]] + grid[idx[1] - 1]) / 2
    special[1] = mid
    special[1, ::BLOCK] = 256.0
    # row 2: saturating blocks: amax in [448, 512) * 2^X, plus other large elements
    special[2] = torch.empty(hidden, dtype=torch.float64).uniform_(300.0, 511.99, generator=g)
    special[2, ::BLOCK] = torch.tensor([448.0, 449.0, 464.0, 479.9, 480.0, 500.0, 511.0, 511.9999])[
        torch.arange(blocks) % 8
    ].double()
    # row 3: powers of two from 2^-30 to 2^9
    special[3] = torch.exp2(k.clamp(-30, 9))
    # row 4: E4M3 subnormal region and its ties (multiples of 2^-10 relative to 2^X)
    special[4] = torch.arange(hidden, dtype=torch.float64).remainder(20) * 2.0**-10
    special[4, ::BLOCK] = 256.0
    # row 5: zero blocks (+0 and -0) alternating with tiny blocks
    special[5] = 0.0
    special[5, BLOCK : 2 * BLOCK] = -0.0
    special[5, 2 * BLOCK :] = log_uniform(1, -140, -120)[0, 2 * BLOCK :]
    # row 6: near fp32 max, and negative numbers that round to -0
    special[6] = log_uniform(1, 100, 127.9)[0]
    special[6, BLOCK : 2 * BLOCK] = -(2.0**-20)
    special[6, BLOCK] = 1.0
    # row 7: finite data, later seeded with NaN and Inf in some blocks
    special[7] = log_uniform(1, -3, 3)[0]
    shift = torch.exp2(torch.tensor([[-100.0], [-40.0], [0.0], [20.0], [-5.0], [0.0], [0.0], [60.0]]))
    special = special * shift.double()
    special = special.float()
    special[7, 3] = math.nan
    special[7, BLOCK + 5] = math.inf
    special[7, 2 * BLOCK + 31] = -math.inf
    special[7, 3 * BLOCK : 4 * BLOCK] = math.nan
    cases["special_fp32"] = special
    cases["special_bf16"] = special.to(torch.bfloat16)
    return cases
