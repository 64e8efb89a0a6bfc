"""The arena's one-launch spill kernel (kernels/arena_spill.py) against a brute-force loop, under
Triton's CPU interpreter: every array (rows, probabilities, return ids, activations) moved for
exactly the rows P .. valid_rows - 1, both directions, nothing else written (canary rows around
every array); spans that would leave either buffer are clipped, counts at or below P move nothing.

    TRITON_INTERPRET=1 python tests/unit/_arena_spill_interp.py
"""

from __future__ import annotations

import os
import sys

import torch

from megatron_ext.kernels.arena_spill import SpillArrays, launch_spill, move_spill

VIEW, SHARED, REGION, H, F = 12, 10, 5, 6, 3
GUARD, CANARY = 2, -77  # rows around every array the run writes, and what they hold


def arrays(seed: int, ids: bool, act: bool) -> SpillArrays:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)
    return SpillArrays(rand(VIEW, H), rand(SHARED, H), torch.randn(VIEW, generator=gen),
                       torch.randn(SHARED, generator=gen),
                       torch.randint(0, 99, (VIEW,), generator=gen, dtype=torch.int32) if ids else None,
                       torch.randint(0, 99, (SHARED,), generator=gen, dtype=torch.int32) if ids else None,
                       rand(VIEW, F) if act else None, rand(SHARED, F) if act else None)


def clone(a: SpillArrays) -> SpillArrays:
    return SpillArrays(*(None if t is None else t.clone() for t in vars(a).values()))


def guarded_clone(a: SpillArrays) -> tuple[SpillArrays, dict[str, torch.Tensor]]:
    """clone(a) with every array a view into a longer buffer with GUARD canary rows on each side (a
    write outside an array lands there, deterministically), and those buffers by field."""
    views, buffers = {}, {}
    for field, tensor in vars(a).items():
        if tensor is None:
            views[field] = None
            continue
        buffers[field] = torch.full((len(tensor) + 2 * GUARD, *tensor.shape[1:]), CANARY, dtype=tensor.dtype)
        views[field] = buffers[field][GUARD:GUARD + len(tensor)]
        views[field].copy_(tensor)
    return SpillArrays(**views), buffers


def brute_force(a: SpillArrays, valid: int, start: int, restore: bool) -> SpillArrays:
    out = clone(a)
    pairs = [("view_rows", "shared_rows"), ("view_values", "shared_values"), ("view_ids", "shared_ids"),
             ("view_act", "shared_act")]
    for j in range(max(valid - REGION, 0)):
        v, s = REGION + j, start + j
        if v >= VIEW or not 0 <= s < SHARED:
            continue
        for view_name, shared_name in pairs:
            view, shared = getattr(out, view_name), getattr(out, shared_name)
            if view is None:
                continue
            if restore:
                view[v] = shared[s]
            else:
                shared[s] = view[v]
    return out


def main() -> int:
    failures, cases = [], 0
    for ids in (False, True):
        for act in (False, True):
            for valid, start in ((0, 0), (5, 3), (7, 0), (9, 4), (12, 3), (12, 8), (11, -2), (20, 0)):
                for restore in (False, True):
                    base = arrays(cases, ids, act)
                    want = brute_force(base, valid, start, restore)
                    for name, run in (("kernel", launch_spill), ("torch form", move_spill)):
                        got, buffers = guarded_clone(base)
                        run(got, torch.tensor(valid, dtype=torch.int32), REGION, torch.tensor(start), restore)
                        for field, tensor in vars(got).items():
                            if tensor is not None and not torch.equal(tensor, getattr(want, field)):
                                failures.append(f"{name} ids={ids} act={act} valid={valid} start={start} "
                                                f"restore={restore}: {field} differs")
                        for field, buffer in buffers.items():
                            if not ((buffer[:GUARD] == CANARY).all() and (buffer[-GUARD:] == CANARY).all()):
                                failures.append(f"{name} ids={ids} act={act} valid={valid} start={start} "
                                                f"restore={restore}: a row outside {field} was written")
                    cases += 1
    return report(cases, failures)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.unit.interpreter import report

    sys.exit(main())
