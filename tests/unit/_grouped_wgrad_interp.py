"""The grouped weight gradient accumulated into main_grad (kernels/grouped_wgrad.py) against the
definition, under Triton's CPU interpreter: out[e] += left_e^T @ right_e over each expert's rows,
fp32 and bf16 outputs, rows read by TMA and (off 16 bytes) by masked loads, sizes that are not
multiples of a tile, an expert with no rows (its output untouched), rows past the last offset
holding NaN (never read), offsets that are a view after another value (expert 0 starts at row 0),
several tile shapes.

    TRITON_INTERPRET=1 python tests/unit/_grouped_wgrad_interp.py
"""

from __future__ import annotations

import os
import sys

import torch


def check_case(counts, m, n, out_dtype, tiles, tail, seed, misaligned=False) -> None:
    from megatron_ext.kernels.grouped_wgrad import accumulate_grouped_wgrad

    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    left = torch.randn(rows + tail, m, generator=gen).bfloat16()
    right = torch.randn(rows + tail, n, generator=gen).bfloat16()
    if misaligned:  # views one column into wider rows: off 16 bytes, so the masked-load path reads them
        left = torch.cat([left[:, :1], left], dim=1)[:, 1:]
        right = torch.cat([right[:, :1], right], dim=1)[:, 1:]
        assert left.data_ptr() % 16 and right.data_ptr() % 16
    left[rows:], right[rows:] = float("nan"), float("nan")  # past ends[-1]: must never be read
    # the offsets are a view after a stray 7: expert 0 starts at row 0, not at what precedes its end
    ends = torch.tensor([7, *counts], dtype=torch.int64)
    ends = torch.cat([ends[:1], ends[1:].cumsum(0)]).to(torch.int32)[1:]
    start = torch.randn(len(counts), m, n, generator=gen).to(out_dtype)
    start[torch.tensor(counts) == 0, ::2] = -0.0  # untouched means bit for bit: an added 0 would make them +0
    expected = start.float().clone()
    first = 0
    for expert, count in enumerate(counts):
        block = slice(first, first + count)
        expected[expert] += left[block].float().t() @ right[block].float()
        first += count
    out = start.clone()
    accumulate_grouped_wgrad(left, right, ends, out, tiles)
    for expert, count in enumerate(counts):
        if count == 0:
            bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
            assert torch.equal(out[expert].view(bits), start[expert].view(bits)), \
                f"expert {expert} has no rows but its output changed"
    assert not out.isnan().any(), "a row past ends[-1] was read"
    tolerance = 1e-4 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.to(out_dtype).float(), rtol=tolerance, atol=tolerance * 8)
    print(f"ok counts={counts} m={m} n={n} {out_dtype} tiles={tuple(tiles)} tail={tail} misaligned={misaligned}")


def check_paths() -> None:
    """Which rows the kernel reads by TMA: 16-bit, 16-byte aligned start and row stride."""
    from megatron_ext.kernels.grouped_wgrad import _tma_descriptor

    box = [16, 16]
    wide = torch.zeros(8, 104, dtype=torch.bfloat16)
    assert _tma_descriptor(wide[:, :48], box) is not None, "aligned bf16 rows must be read by TMA"
    assert _tma_descriptor(torch.zeros(8, 100, dtype=torch.bfloat16), box) is None, "a 200-byte row stride"
    assert _tma_descriptor(wide[:, 1:49], box) is None, "a start off 16 bytes"
    assert _tma_descriptor(torch.zeros(8, 48), box) is None, "fp32 rows"
    print("ok paths")


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from megatron_ext.kernels.grouped_wgrad import WgradTiles
    from tests.unit.interpreter import fix_interpreter_bf16_dot, interpreter_ready

    if not interpreter_ready():
        return 2
    fix_interpreter_bf16_dot()
    small = WgradTiles(block_m=32, block_n=16, block_rows=16, warps=4, stages=2)
    check_case([40, 0, 17, 70], m=48, n=40, out_dtype=torch.float32, tiles=small, tail=5, seed=0)
    check_case([40, 0, 17, 70], m=48, n=40, out_dtype=torch.bfloat16, tiles=small, tail=5, seed=1)
    check_case([1, 33, 0], m=64, n=32, out_dtype=torch.float32, tiles=WgradTiles(block_m=64, block_n=32, block_rows=32),
               tail=0, seed=2)
    check_case([0, 0], m=16, n=16, out_dtype=torch.float32, tiles=small, tail=3, seed=3)
    check_case([130, 7], m=24, n=72, out_dtype=torch.float32, tiles=WgradTiles(), tail=9, seed=4)
    check_case([40, 0, 17, 70], m=48, n=40, out_dtype=torch.float32, tiles=small, tail=5, seed=5, misaligned=True)
    check_case([40, 0, 17, 70], m=48, n=40, out_dtype=torch.bfloat16, tiles=small, tail=5, seed=6, misaligned=True)
    whole_steps = WgradTiles(block_m=32, block_n=32, block_rows=32)  # every count a multiple: no partial step
    check_case([64, 128, 32], m=32, n=48, out_dtype=torch.float32, tiles=whole_steps, tail=4, seed=7)
    # one expert; an aligned start but rows of 100 x 2 bytes, off 16: masked loads
    check_case([45], m=100, n=24, out_dtype=torch.float32, tiles=small, tail=2, seed=8)
    check_paths()
    print("all grouped wgrad interpreter checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
