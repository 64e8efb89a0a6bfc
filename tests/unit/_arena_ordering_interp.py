"""The dropless arena's ordering across simulated EP ranks, under Triton's CPU interpreter.

Run in a fresh process with TRITON_INTERPRET=1 (tests/unit/test_symm_ordering.py does):

    TRITON_INTERPRET=1 python tests/unit/_arena_ordering_interp.py [--spill-deferred | --no-spill] [--case NAME]

Threads act as EP ranks over megatron_ext.testing.threaded_peers with the real SymmRowTransport
of each of LAYERS MoE layers sharing one RowArena per rank (moe/arena.py): the layers' PUTs land
in the arena's region views, a stand-in expert (x -> 2 p x on the valid rows) reads its rows,
spills its rows past P (ArenaRows.spill) and hands its output to the combine, whose
barrier orders the spill before any peer's PUT of the next layer into region i+1. The backward
runs the layers in reverse and restores each layer's spill before its "experts" read the rows.
Checked per rank, layer, microbatch and step: output, token and probability gradients, and the
rows the backward reads against the rows the dispatch delivered. Delays let one rank run ahead
as far as the barriers allow.

A spill after the combine's barrier would still be safe: the next layer's count exchange is a
second barrier every rank passes only after its spill. --spill-deferred moves each spill after
the next layer's dispatch (the PUTs into region i+1 land first), and --no-spill drops it; both
runs must fail, which shows the check sees rows overwritten before they were kept. --return-put
runs the transports with return_transfer="put", whose dispatch backward sends rows back by the
return ids that spill with them; --no-id-spill leaves those ids behind, which must fail. Exits 0
when every case passes.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from megatron_ext.kernels import arena_spill
from megatron_ext.moe.arena import ArenaLayer, RowArena
from megatron_ext.moe.route_map import route
from megatron_ext.moe.transport import put_return, symm
from megatron_ext.moe.transport.symm import SymmRowTransport
from megatron_ext.testing.threaded_peers import (ThreadedPeers, failed_checks, phase_delay, report_case,
                                                 schedule_events, serialize_kernels)

serialize_kernels(symm)
serialize_kernels(put_return)

HIDDEN, TOKENS, TOPK, EXPERTS_PER_RANK, LAYERS = 16, 16, 2, 2, 3

# name: (world, capacity factor, region factor, lease slots, schedule, delay mode, steps)
CASES = {
    "ep2_spills_late_rank0": (2, 1.5, 0.5, 1, "F0 B0", "late0", 3),
    "ep2_two_mb_random": (2, 1.5, 0.5, 2, "F0 F1 B1 B0", "random", 6),
    "ep4_spills_late_rank1": (4, 1.5, 0.5, 1, "F0 B0", "late1", 2),
}


def layer_inputs(world: int, step: int, mb: int, layer: int, rank: int):
    """Fresh routes and values per (step, microbatch, layer, rank), skewed to expert 0 half the time."""
    gen = torch.Generator().manual_seed(10000 * step + 100 * mb + 10 * layer + rank)
    weights = torch.ones(EXPERTS_PER_RANK * world)
    if (step + mb + layer) % 2:
        weights[0] = 3.0 * world
    top_idx = torch.stack([torch.multinomial(weights, TOPK, replacement=False, generator=gen)
                           for _ in range(TOKENS)]).sort(1).values
    return top_idx, torch.randn(TOKENS, HIDDEN, generator=gen), torch.rand(TOKENS, TOPK, generator=gen), \
        torch.randn(TOKENS, HIDDEN, generator=gen)


def rank_main(rank, world, cf, region_factor, slots, schedule, delay, steps, seed, spill, return_put):
    arena = RowArena(LAYERS, cf, region_factor, lease_slots=slots)
    arena.configure(TOKENS, TOPK)
    layers = [ArenaLayer(arena, i) for i in range(LAYERS)]
    heap = PEERS.heap(rank)
    transports = []
    for layer in layers:
        transport = SymmRowTransport(None, layer.capacity, heap=heap, rank=rank, world=world, return_put=return_put)
        transport.slot_source = layer.lease
        transports.append(transport)
    arena.allocate(heap, world, rank, HIDDEN, torch.float32, "cpu", return_ids=return_put)
    rng = random.Random(seed * 97 + rank)
    failures, spilled = [], 0

    wait = phase_delay(delay, rank, rng, PEERS)

    def forward(step, mb):
        saved, pending = [], None
        for index, (layer, transport) in enumerate(zip(layers, transports)):
            top_idx, tokens, probs, _ = layer_inputs(world, step, mb, index, rank)
            cursor = layer.begin_forward(dispatch_has_backward=True)
            rmap = route(top_idx, EXPERTS_PER_RANK * world, layer.capacity, gather_counts=transport.gather_counts,
                         ep_rank=rank, dest_capacity=cursor.capacities())
            cursor.advance(rmap.metrics.kept_per_expert)
            rows_at = layer.rows(cursor)
            slot, slot_probs, lease = transport.dispatch(tokens, probs, rmap)
            if pending is not None:  # --spill-deferred: the previous layer's spill, after this dispatch
                pending[0].spill(pending[1])
                pending = None
            valid_rows = rmap.recv_offsets[-1]
            valid = (torch.arange(layer.capacity) < valid_rows)[:, None]
            delivered = (torch.where(valid, slot, 0), torch.where(valid[:, 0], slot_probs, 0))
            out_rows = torch.where(valid, 2 * slot_probs[:, None] * slot, 0.0)  # the "experts" read their rows
            wait()
            if spill == "in order":
                rows_at.spill(valid_rows)
            elif spill == "deferred":
                pending = (rows_at, valid_rows)
            out = transport.combine(out_rows, rmap)
            saved.append((rmap, lease, slot, slot_probs, valid, valid_rows, rows_at, delivered, out.clone()))
        return saved

    def backward(step, mb, saved):
        nonlocal spilled
        for index in reversed(range(LAYERS)):
            rmap, lease, slot, slot_probs, valid, valid_rows, rows_at, delivered, out = saved[index]
            top_idx, tokens, probs, grad_out = layer_inputs(world, step, mb, index, rank)
            transport = transports[index]
            kept = (rmap.dest_row >= 0).float()
            weight = (kept * probs).sum(1, keepdim=True)
            grad_rows = transport.combine_backward(grad_out, rmap)
            wait()
            rows_at.restore(valid_rows)
            spilled += max(int(valid_rows) - arena.layout.region, 0) * (index < LAYERS - 1)
            grad_slot = torch.where(valid, 2 * slot_probs[:, None] * grad_rows, 0.0)
            grad_slot_probs = torch.where(valid[:, 0], 2 * (grad_rows * slot).sum(1), 0.0)
            read_back = (torch.where(valid, slot, 0), torch.where(valid[:, 0], slot_probs, 0))
            grad_tokens, grad_probs = transport.dispatch_backward(grad_slot, grad_slot_probs, rmap)
            transport.release(lease)
            checks = {
                "output": (out, 2 * weight * tokens),
                "token gradient": (grad_tokens, 2 * weight * grad_out),
                "probability gradient": (grad_probs, 2 * kept * (grad_out * tokens).sum(1, keepdim=True)),
                "rows read by the backward": (read_back[0], delivered[0]),
                "probabilities read by the backward": (read_back[1], delivered[1]),
            }
            failures.extend(failed_checks(checks, f"rank {rank} step {step} mb {mb} layer {index}"))

    for step in range(steps):
        live = {}
        for kind, mb in schedule_events(schedule):
            wait()
            if kind == "F":
                live[mb] = forward(step, mb)
            else:
                backward(step, mb, live.pop(mb))
    return failures, spilled


def run_case(name: str, spill: str, return_put: bool = False, seed: int = 0):
    global PEERS
    world, cf, region_factor, slots, schedule, delay, steps = CASES[name]
    PEERS = ThreadedPeers(world)
    results = PEERS.run(rank_main, world, cf, region_factor, slots, schedule, delay, steps, seed, spill, return_put)
    return [f for failures, _ in results for f in failures], sum(s for _, s in results)


def main() -> int:
    from tests.unit.interpreter import interpreter_ready, shard

    if not interpreter_ready():
        return 2
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--spill-deferred", action="store_true",
                        help="spill after the next layer's dispatch (must fail)")
    parser.add_argument("--no-spill", action="store_true", help="never spill (must fail)")
    parser.add_argument("--return-put", action="store_true",
                        help="return_transfer='put': the rows' return ids spill and come back with them")
    parser.add_argument("--no-id-spill", action="store_true",
                        help="with --return-put, spill everything but the return ids (must fail)")
    parser.add_argument("--shard", metavar="K/N", help="run every Nth chosen case from the Kth (0-based)")
    args = parser.parse_args()
    if args.no_id_spill:
        copy = arena_spill.copy_row_span

        def copy_all_but_ids(src, dst, *rest, **options):
            return dst if src.dtype == torch.int32 else copy(src, dst, *rest, **options)
        arena_spill.copy_row_span = copy_all_but_ids
    spill = "deferred" if args.spill_deferred else "never" if args.no_spill else "in order"
    outcomes = [(name, *run_case(name, spill, args.return_put)) for name in shard(args.case or CASES, args.shard)]
    failed = [report_case(name, failures, f"rows spilled {spilled}") for name, failures, spilled in outcomes]
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
