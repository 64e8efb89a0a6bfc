"""copy_row_span's torch form (CPU; the GPU test compares the Triton kernel with it) against a loop."""

import pytest
import torch

from megatron_ext.kernels.row_span import copy_row_span


def brute_force(src, dst, count, src_start, dst_start):
    out = dst.clone()
    for j in range(max(count, 0)):
        s, d = src_start + j, dst_start + j
        if 0 <= s < src.shape[0] and 0 <= d < dst.shape[0]:
            out[d] = src[s]
    return out


@pytest.mark.parametrize("count,src_start,dst_start", [(0, 0, 0), (3, 0, 0), (5, 2, 7), (-4, 0, 0), (20, 1, 3),
                                                       (4, 9, 0), (6, 0, 10)])
@pytest.mark.parametrize("width", [None, 5])
def test_span_equals_a_loop(count, src_start, dst_start, width):
    shape = (10,) if width is None else (10, width)
    src = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    dst = -torch.ones((12,) + shape[1:])
    want = brute_force(src, dst, count, src_start, dst_start)
    got = copy_row_span(src, dst.clone(), torch.tensor(count), torch.tensor(src_start), torch.tensor(dst_start))
    assert torch.equal(got, want)
    values, values_out = torch.arange(10.0), torch.zeros(12)
    copy_row_span(src, dst.clone(), count, src_start, dst_start, values=(values, values_out))
    assert torch.equal(values_out, brute_force(values, torch.zeros(12), count, src_start, dst_start))


def test_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="one width and dtype"):
        copy_row_span(torch.zeros(4, 3), torch.zeros(4, 2), 1)


def test_arena_spill_kernel_and_torch_form_equal_a_loop():
    from tests.unit.interpreter import run_under_interpreter

    assert "64 cases, 0 failures" in run_under_interpreter("_arena_spill_interp.py")


def test_row_span_kernel_equals_a_loop():
    """The Triton kernel itself (the GPU path; the test above runs the torch form): clipped spans,
    negative starts, masked columns, the values, no write past the destination."""
    from tests.unit.interpreter import run_under_interpreter

    assert "22 cases, 0 failures" in run_under_interpreter("_row_span_interp.py")


def test_spill_arrays_refuse_a_shared_area_not_laid_out_as_its_rows():
    """The spill kernel indexes every shared array with the token rows' shared row numbers: a shared
    array with fewer rows, or a strided one, is refused (the view side is checked elsewhere)."""
    from megatron_ext.kernels.arena_spill import SpillArrays

    rows, values = torch.zeros(10, 4), torch.zeros(10)
    with pytest.raises(ValueError, match="values have 10 view and 5 shared rows, the token rows 10 and 6"):
        SpillArrays(rows, rows[:6], values, values[:5])
    with pytest.raises(ValueError, match="the rows arrays must be contiguous"):
        SpillArrays(rows, torch.zeros(4, 6).t(), values, values[:6])
