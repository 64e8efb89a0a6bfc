"""Ordering of the symm transport across simulated ranks, under Triton's CPU interpreter.

Run in a fresh process with TRITON_INTERPRET=1 (tests/unit/test_symm_ordering.py does):

    TRITON_INTERPRET=1 python tests/unit/_symm_ordering_interp.py [--unfenced-poison] [--case NAME]

Two (or more) threads act as EP ranks over megatron_ext.testing.threaded_peers: the real
SymmRowTransport and its Triton kernels write into each other's CPU buffers, and the only
cross-rank order is the transport's own barriers. Every step draws fresh routes; a stand-in
expert (x -> 2x on the valid rows, tails untouched) runs between dispatch and combine, so a
stale or poisoned row read anywhere shows up in an output. Checked per rank, microbatch and
step: output, token gradient and the leased dispatch rows at backward time against values
computed from the route map alone. Adversarial delays (seeded, or one rank always late) make
the fast peer's writes land as early as the barriers allow.

--unfenced-poison replays the pre-fix poison (fill without a barrier): the run must then fail,
which shows that the check can see the race. --fused-route-map runs FUSED_CASES with the GPU
route map (Triton select and route kernels, counts exchanged over the simulated symmetric
memory) instead of the torch one. --return-put runs PUT_RETURN_CASES with return_transfer="put"
(combine and dispatch backward PUT the rows back, transport/put_return.py); with
--unfenced-put-back, minus the barrier between that PUT and the sum, which must then fail.
--drop-barrier PHASE drops one of the transport's phase barriers on every rank: some case must
then fail (each barrier is needed, and the checks can see it missing). Exits 0 when every case passes.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from megatron_ext.kernels import route_plan
from megatron_ext.moe import fused_routes
from megatron_ext.moe.capacity import rank_capacity
from megatron_ext.moe.route_map import route
from megatron_ext.moe.transport import put_return, symm
from megatron_ext.moe.transport.symm import SymmRowTransport
from megatron_ext.testing.threaded_peers import (ThreadedPeers, failed_checks, phase_delay, report_case,
                                                 schedule_events, serialize_kernels)

serialize_kernels(symm)
serialize_kernels(put_return)
serialize_kernels(route_plan, names=("select_routes", "select_backward", "plan_and_place"))

HIDDEN, TOKENS, TOPK, EXPERTS_PER_RANK = 32, 8, 2, 2

# name: (world, capacity factor, lease slots, schedule, poison, delay mode, steps)
# A schedule is the per-step order of forward (F) and backward (B) microbatches.
CASES = {
    "cf1.0_one_mb_poison_late_rank0": (2, 1.0, 1, "F0 B0", True, "late0", 6),
    "cf1.25_one_mb_poison_random": (2, 1.25, 1, "F0 B0", True, "random", 20),
    "cf1.0_two_mb_interleaved_poison": (2, 1.0, 2, "F0 F1 B0 B1", True, "random", 20),
    "cf1.25_two_mb_reversed_no_poison": (2, 1.25, 2, "F0 F1 B1 B0", False, "random", 20),
    "cf1.0_two_mb_late_rank1_poison": (2, 1.0, 2, "F0 F1 B1 B0", True, "late1", 6),
    "ep4_cf1.0_poison_random": (4, 1.0, 1, "F0 B0", True, "random", 6),
    "cf1.0_one_mb_late_rank0": (2, 1.0, 1, "F0 B0", False, "late0", 6),  # no poison barrier to hide behind
}
FUSED_CASES = {
    "fused_cf1.0_two_mb_reversed_poison": (2, 1.0, 2, "F0 F1 B1 B0", True, "random", 8),
    "fused_ep4_cf1.0_poison_late_rank1": (4, 1.0, 1, "F0 B0", True, "late1", 4),
}
# return_transfer="put": combine and dispatch backward PUT rows back into the sources' buffers
PUT_RETURN_CASES = {
    "put_cf1.0_two_mb_interleaved_poison": (2, 1.0, 2, "F0 F1 B0 B1", True, "random", 12),
    "put_cf1.25_two_mb_reversed_late_rank0": (2, 1.25, 2, "F0 F1 B1 B0", True, "late0", 6),
    "put_ep4_cf1.0_poison_late_rank1": (4, 1.0, 1, "F0 B0", True, "late1", 4),
    "put_cf1.0_one_mb_late_rank1": (2, 1.0, 1, "F0 B0", False, "late1", 4),  # no poison barrier to hide behind
    "put_uneven_tokens_two_mb_poison": (2, 1.25, 2, "F0 F1 B1 B0", True, "random", 8),
}
# Rank r holds TOKENS - 3 * r tokens in every microbatch (T_max = TOKENS sizes every rank's buffers):
# a put-back bounded by the owner's own T * K dropped a larger source's routes past it.
UNEVEN_CASES = {"put_uneven_tokens_two_mb_poison", "cf1.25_uneven_tokens_two_mb_poison"}
CASES["cf1.25_uneven_tokens_two_mb_poison"] = (2, 1.25, 2, "F0 F1 B1 B0", True, "random", 8)


def step_inputs(world: int, step: int, mb: int, rank: int, tokens: int = TOKENS):
    """Fresh routes and values for (step, microbatch, rank): skewed towards expert 0 half the time."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    num_experts = EXPERTS_PER_RANK * world
    weights = torch.ones(num_experts)
    if (step + mb) % 2:
        weights[0] = 4.0 * num_experts  # a hot expert: drops at cf 1.0
    top_idx = torch.stack([torch.multinomial(weights, TOPK, replacement=False, generator=gen)
                           for _ in range(tokens)]).sort(1).values
    rows = torch.randn(tokens, HIDDEN, generator=gen)
    probs = torch.rand(tokens, TOPK, generator=gen)
    grad_out = torch.randn(tokens, HIDDEN, generator=gen)
    return top_idx, rows, probs, grad_out


def fused_route_map(top_idx, probs, num_experts, capacity, transport, rank):
    """The GPU path's route map from the [T, E] routing map these routes make."""
    routing_map = torch.zeros(top_idx.shape[0], num_experts, dtype=torch.bool).scatter_(1, top_idx, True)
    dense_probs = torch.zeros(routing_map.shape).scatter_(1, top_idx, probs)
    fused_idx, _, selection = fused_routes.select(routing_map, dense_probs, top_idx.shape[1])
    assert torch.equal(fused_idx.long(), top_idx), "fused select reordered the routes"
    return fused_routes.route(selection, top_idx.shape[1], capacity, gather_counts=transport.gather_counts,
                              ep_rank=rank, need_row_source=False)


def rank_main(rank, world, cf, slots, schedule, poison, delay, steps, seed, fused=False, return_put=False,
              uneven=False):
    num_experts = EXPERTS_PER_RANK * world
    capacity = rank_capacity(TOKENS, TOPK, world, cf, False)
    transport = SymmRowTransport(None, capacity, lease_slots=slots, poison=poison, heap=PEERS.heap(rank), rank=rank,
                                 world=world, return_put=return_put, max_routes=TOKENS * TOPK)
    my_tokens = TOKENS - 3 * rank if uneven else TOKENS
    rng = random.Random(seed * 97 + rank)
    failures, dropped = [], 0

    wait = phase_delay(delay, rank, rng, PEERS)

    for step in range(steps):
        live = {}
        for kind, mb in schedule_events(schedule):
            wait()
            if kind == "F":
                top_idx, tokens, probs, _ = step_inputs(world, step, mb, rank, my_tokens)
                if fused:
                    rmap = fused_route_map(top_idx, probs, num_experts, capacity, transport, rank)
                else:
                    rmap = route(top_idx, num_experts, capacity, gather_counts=transport.gather_counts, ep_rank=rank)
                slot, slot_probs, lease = transport.dispatch(tokens, probs, rmap)
                valid = (torch.arange(capacity) < rmap.recv_offsets[-1])[:, None]
                at_dispatch = (slot.clone(), slot_probs.clone())
                wait()
                # "experts": 2 * p * row on the valid rows; the tail (NaN with poison) passes unread
                out = transport.combine(torch.where(valid, 2 * slot_probs[:, None] * slot, slot), rmap)
                if poison and not return_put:  # the GET source's unread tail: NaN, so a stray read would show
                    source_tail = transport._scratch("combine_source", slot).local[int(rmap.recv_offsets[-1]):]
                    if not source_tail.isnan().all():
                        failures.append(f"rank {rank} step {step} mb {mb}: combine source tail not poisoned")
                live[mb] = (rmap, lease, slot, slot_probs, valid, at_dispatch, out.clone())
            else:
                rmap, lease, slot, slot_probs, valid, at_dispatch, out = live.pop(mb)
                top_idx, tokens, probs, grad_out = step_inputs(world, step, mb, rank, my_tokens)
                kept = (rmap.dest_row >= 0).float()
                dropped += int((rmap.dest_row < 0).sum())
                weight = (kept * probs).sum(1, keepdim=True)
                grad_rows = transport.combine_backward(grad_out, rmap)
                wait()
                # the "experts'" backward: d row = 2 * p * d out, d p = 2 * dot(d out, row)
                grad_slot = torch.where(valid, 2 * slot_probs[:, None] * grad_rows, 0.0)
                grad_slot_probs = torch.where(valid[:, 0], 2 * (grad_rows * slot).sum(1), 0.0)
                grad_tokens, grad_probs = transport.dispatch_backward(grad_slot, grad_slot_probs, rmap)
                checks = {
                    "output": (out, 2 * weight * tokens),
                    "token gradient": (grad_tokens, 2 * weight * grad_out),
                    "probability gradient": (grad_probs, 2 * kept * (grad_out * tokens).sum(1, keepdim=True)),
                    "leased rows at backward": (torch.where(valid, slot, 0), torch.where(valid, at_dispatch[0], 0)),
                    "leased probabilities at backward": (torch.where(valid[:, 0], slot_probs, 0),
                                                         torch.where(valid[:, 0], at_dispatch[1], 0)),
                }
                transport.release(lease)
                failures += failed_checks(checks, f"rank {rank} step {step} mb {mb}")
    return failures, dropped


def run_case(name: str, seed: int = 0):
    global PEERS
    fused, return_put = name in FUSED_CASES, name in PUT_RETURN_CASES
    world, cf, slots, schedule, poison, delay, steps = {**CASES, **FUSED_CASES, **PUT_RETURN_CASES}[name]
    PEERS = ThreadedPeers(world)
    results = PEERS.run(rank_main, world, cf, slots, schedule, poison, delay, steps, seed, fused, return_put,
                        name in UNEVEN_CASES)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    dropped = sum(d for _, d in results)
    return failures, dropped, PEERS.barriers_passed


def main() -> int:
    from tests.unit.interpreter import interpreter_ready, shard
    from tests.unit.symm_mutations import PHASES, drop_fences, unfence_poison

    if not interpreter_ready():
        return 2
    parser = argparse.ArgumentParser()
    parser.add_argument("--unfenced-poison", action="store_true")
    parser.add_argument("--case", action="append", choices=sorted({**CASES, **FUSED_CASES, **PUT_RETURN_CASES}))
    parser.add_argument("--fused-route-map", action="store_true", help="run FUSED_CASES instead")
    parser.add_argument("--return-put", action="store_true", help="run PUT_RETURN_CASES instead")
    parser.add_argument("--unfenced-put-back", action="store_true",
                        help="drop the barrier between the PUT back and the sum (the run must then fail)")
    parser.add_argument("--drop-barrier", choices=PHASES,
                        help="drop this phase's barrier on every rank (the run must then fail)")
    parser.add_argument("--shard", metavar="K/N", help="run every Nth chosen case from the Kth (0-based)")
    args = parser.parse_args()
    if args.drop_barrier:
        drop_fences(lambda transport, phase: phase == args.drop_barrier)
    if args.unfenced_put_back:
        drop_fences(lambda transport, phase: transport.return_put and phase in ("combine", "dispatch backward"))
    if args.unfenced_poison:  # the pre-fix behaviour: fill without ordering against peers
        unfence_poison()
    bad = 0
    chosen = args.case or (FUSED_CASES if args.fused_route_map else PUT_RETURN_CASES if args.return_put else CASES)
    for name in shard(chosen, args.shard):
        failures, dropped, barriers = run_case(name)
        bad += report_case(name, failures, f"dropped routes {dropped}, barriers per rank {barriers}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
