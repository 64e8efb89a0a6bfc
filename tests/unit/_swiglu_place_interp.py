"""The SwiGLU kernels (kernels/swiglu.py) reading fc1's rows in two parts, under Triton's CPU
interpreter, against the torch forms on the same rows:

- forward from a split buffer (rows below P in one tensor, the rest in another from a device row
  on), storing the rows past P where the arena keeps them (`save_to`): the activation as the
  torch form's, the stored rows bitwise the rows read, and no other row of the store written;
- the forward and backward reading a kept RowPlace (the region tensor and the shared area's rows
  from the layer's spill start) as the torch form reads the same rows gathered;
- the plain buffer (no place) as before.

    TRITON_INTERPRET=1 python tests/unit/_swiglu_place_interp.py
"""

from __future__ import annotations

import os
import sys

import torch

from megatron_ext.kernels.row_span import device_int
from megatron_ext.kernels.swiglu import (RowPlace, _backward_torch, _forward_torch, gather_place, launch_backward,
                                         launch_forward)

ROWS, REGION, SHARED, F = 12, 5, 16, 24  # F not a power of two: the kernels' column masks are used


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def check(case: str, valid: int, spill_start: int, with_prob: bool) -> list[str]:
    gen = torch.Generator().manual_seed(valid * 100 + spill_start * 10 + with_prob)
    failures = []
    valid_rows = torch.tensor(valid, dtype=torch.int32)
    prob = torch.rand(ROWS, generator=gen) if with_prob else None
    fresh = RowPlace(rand(gen, REGION, 2 * F), rand(gen, ROWS - REGION, 2 * F), device_int(0, valid_rows))
    shared = rand(gen, SHARED, 2 * F)
    kept = RowPlace(fresh.region_rows, shared, torch.tensor(spill_start, dtype=torch.int64))
    rows = gather_place(fresh, ROWS, valid_rows)
    shared_before = shared.clone()

    act = launch_forward(None, valid_rows, prob, kept, fresh, torch.zeros(ROWS, F, dtype=torch.bfloat16))
    want = _forward_torch(rows, prob, valid_rows)
    if not torch.allclose(act[:valid].float(), want[:valid].float(), rtol=1e-2, atol=1e-2):
        failures.append(f"{case}: forward from the split rows differs from the torch form")
    stored = shared_before.clone()
    past = max(valid - REGION, 0)
    stored[spill_start:spill_start + past] = rows[REGION:REGION + past]
    if not torch.equal(shared, stored):
        failures.append(f"{case}: the shared rows are not exactly the rows past P at the spill start")

    act_kept = launch_forward(None, valid_rows, prob, None, kept, torch.zeros(ROWS, F, dtype=torch.bfloat16))
    if not torch.equal(act_kept[:valid], act[:valid]):
        failures.append(f"{case}: forward reading the kept rows differs from the forward that kept them")

    grad = rand(gen, ROWS, F)
    grad_h, grad_prob = launch_backward(grad, None, prob, valid_rows, kept)
    want_h, want_prob = _backward_torch(grad, rows, prob, valid_rows)
    if not torch.allclose(grad_h[:valid].float(), want_h[:valid].float(), rtol=1e-2, atol=1e-2):
        failures.append(f"{case}: backward reading the kept rows differs from the torch form")
    if with_prob and not torch.allclose(grad_prob[:valid], want_prob[:valid].float(), rtol=1e-2, atol=1e-2):
        failures.append(f"{case}: the probability gradient differs from the torch form")

    plain_h, plain_prob = launch_backward(grad, rows, prob, valid_rows, None)
    plain_act = launch_forward(rows, valid_rows, prob, None, None, torch.zeros(ROWS, F, dtype=torch.bfloat16))
    if not (torch.equal(plain_act[:valid], act[:valid]) and torch.equal(plain_h[:valid], grad_h[:valid])
            and (not with_prob or torch.equal(plain_prob, grad_prob))):
        failures.append(f"{case}: the kernels on the plain buffer differ from the kernels on the place")
    return failures


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(entries that differ, the largest difference in bf16 steps) of two bf16 tensors."""
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    return int((steps != 0).sum()), int(steps.max()) if steps.numel() else 0


def check_against_autograd(case: str, valid: int) -> list[str]:
    """The plain-buffer kernels against torch autograd of silu(gate) * up * prob in fp32 (then one
    rounding to bf16): the activation and d h as one rounding of the fp32 result (at most 1% of the
    entries a bf16 step off: sigmoid's last fp32 bit differs between libraries), d prob to fp32
    rounding; rows at or past valid_rows unwritten, d prob zero there."""
    gen = torch.Generator().manual_seed(77 + valid)
    failures = []
    h, grad = rand(gen, ROWS, 2 * F) * 3, rand(gen, ROWS, F)
    prob = torch.rand(ROWS, generator=gen) + 0.1
    valid_rows = torch.tensor(valid, dtype=torch.int32)
    leaf, prob_leaf = h.float().requires_grad_(True), prob.clone().requires_grad_(True)
    gate, up = leaf[:, :F], leaf[:, F:]
    want = gate * torch.sigmoid(gate) * up * prob_leaf[:, None]
    want.backward(grad.float())

    sentinel = torch.full((ROWS, F), -3.0, dtype=torch.bfloat16)
    act = launch_forward(h, valid_rows, prob, None, None, sentinel.clone())
    grad_h, grad_prob = launch_backward(grad, h, prob, valid_rows, None)
    checks = (("activation", act[:valid], want.detach()[:valid].bfloat16()),
              ("d h", grad_h[:valid], leaf.grad[:valid].bfloat16()))
    for name, got, expected in checks:
        differ, steps = bf16_steps(got, expected)
        if steps > 1 or differ > got.numel() // 100:
            failures.append(f"{case}: {name}: {differ} entries differ from one rounding of fp32, up to {steps} steps")
    if not torch.allclose(grad_prob[:valid], prob_leaf.grad[:valid], rtol=1e-5, atol=1e-6):
        failures.append(f"{case}: d prob differs from autograd's")
    if not (torch.equal(act[valid:], sentinel[valid:]) and not grad_prob[valid:].any()):
        failures.append(f"{case}: a row at or past valid_rows was written (activation) or d prob is not 0 there")
    return failures


def main() -> int:
    from tests.unit.interpreter import interpreter_ready, report

    if not interpreter_ready():  # fp32 -> bf16 casts round to nearest even, as on a GPU
        return 2
    failures, cases = [], 0
    for valid in (0, 3, REGION, REGION + 1, ROWS):  # none, below P, exactly P, one past, all
        for spill_start in (0, 4):
            for with_prob in (False, True):
                cases += 1
                failures += check(f"valid {valid} spill {spill_start} prob {with_prob}", valid, spill_start,
                                  with_prob)
    for valid in (ROWS - 3, ROWS):
        cases += 1
        failures += check_against_autograd(f"against autograd, valid {valid}", valid)
    return report(cases, failures)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
