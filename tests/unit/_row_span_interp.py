"""copy_row_span's Triton kernel (kernels/row_span.py) against a brute-force loop, under Triton's
CPU interpreter. The wrapper launches the kernel only for CUDA tensors, so the rows here are CPU
tensors of a subclass that says it is on CUDA: the wrapper's own launch runs, the interpreter
executes it. Spans inside both buffers, clipped at either end of either buffer, negative starts,
counts at or below 0, rows of one value (1-D) and of a width below the kernel's block (masked
columns), with and without the per-row values; nothing outside the span written.

    TRITON_INTERPRET=1 python tests/unit/_row_span_interp.py
"""

from __future__ import annotations

import os
import sys

import torch

CANARY = 2


class OnDevice(torch.Tensor):
    """A CPU tensor that copy_row_span takes for a CUDA one (its Triton path)."""

    @property
    def is_cuda(self):
        return True


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from megatron_ext.kernels.row_span import copy_row_span
    from tests.unit.interpreter import report
    from tests.unit.test_row_span import brute_force

    failures, cases = [], 0
    spans = [(0, 0, 0), (3, 0, 0), (5, 2, 7), (-4, 0, 0), (20, 1, 3), (4, 9, 0), (6, 0, 10), (5, -2, 1),
             (5, 1, -3), (4, 8, 9), (12, 0, 0)]
    for width in (None, 5):
        for count, src_start, dst_start in spans:
            shape = (10,) if width is None else (10, width)
            src = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
            dst = -torch.ones((12,) + shape[1:])
            values, values_out = torch.arange(10.0) + 100, -torch.ones(12)
            want = brute_force(src, dst, count, src_start, dst_start)
            want_values = brute_force(values, values_out, count, src_start, dst_start)
            # the destinations are views of longer buffers: a write past their end lands in the canary rows
            backing = torch.cat([dst, torch.full_like(dst[:CANARY], -5.0)])
            values_backing = torch.cat([values_out, torch.full((CANARY,), -5.0)])
            got, got_values = backing[:12].as_subclass(OnDevice), values_backing[:12].as_subclass(OnDevice)
            copy_row_span(src.clone().as_subclass(OnDevice), got, torch.tensor(count), torch.tensor(src_start),
                          torch.tensor(dst_start), values=(values.as_subclass(OnDevice), got_values))
            case = f"width={width} count={count} src_start={src_start} dst_start={dst_start}"
            if not torch.equal(backing[:12], want) or not (backing[12:] == -5.0).all():
                failures.append(f"{case}: rows differ from the loop, or a row past dst was written")
            if not torch.equal(values_backing[:12], want_values) or not (values_backing[12:] == -5.0).all():
                failures.append(f"{case}: values differ from the loop, or a value past dst was written")
            cases += 1
    return report(cases, failures)


if __name__ == "__main__":
    sys.exit(main())
