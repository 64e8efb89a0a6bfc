"""The whole RowwiseMoELayer over the symm transport on forked EP ranks.

    TRITON_INTERPRET=1 python tests/unit/_symm_layer_interp.py [--case NAME ...] [--shard K/N]
        [--late-rank R] [--steps N] [--drop-barrier PHASE ...] [--unfenced-poison]

Each rank is a gloo process with its own Megatron parallel state; the symm transport's heap is a
shared-memory pool (megatron_ext.testing.forked_peers), so router, dispatcher, autograd and
experts run as in training and the row kernels (interpreted) store into peers' buffers for
real, concurrently. CASES check one layer step against the dense oracle (layer_check);
STACK_CASES check stacks of layers over several steps, bitwise against the torch transport, with
one rank late. --drop-barrier PHASE drops one of the transport's phase barriers on every rank (a
mutation: some case must then fail; repeated, the cases run once per phase); --unfenced-poison
drops the poison fill's barrier. Prints "ok NAME ..." or "FAIL NAME ..." per case; exits 1
on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (EP ranks, MoEExtConfig settings, layer_check.Case settings)
CASES = {
    "ep2_dropless": (2, dict(dropless=True), dict(experts=8, tokens=12)),
    "ep2_cf0.5_drops_poison": (2, dict(capacity_factor=0.5, debug_poison=True), dict(experts=8, tokens=16)),
    "ep2_put_return_poison": (2, dict(dropless=True, return_transfer="put", debug_poison=True),
                              dict(experts=8, tokens=12)),
    "ep3_uneven_cf0.5": (3, dict(capacity_factor=0.5), dict(experts=6, tokens=16, tokens_per_rank=(16, 5, 11))),
    "ep4_dropless_poison": (4, dict(dropless=True, debug_poison=True), dict(experts=8, tokens=8)),
}

# name -> (EP ranks, symm settings, the torch transport's settings, layers, schedule, steps, router skew,
# late rank). A stack of layers (each fed the previous output plus the tokens) over the symm transport
# against the same stack over the torch transport (gloo collectives): fresh tokens every step; outputs,
# input gradients and every weight gradient bitwise equal. The skew sends most tokens' first route to
# expert 0, so rank 0 receives more rows than a balanced share (the arena then spills). The late rank
# waits before each of its transport kernels and after each barrier until its peers park at a barrier
# or finish: they run ahead as far as the barriers let them.
STACK_CASES = {
    "ep2_two_live_microbatches_poison": (2, dict(dropless=True, lease_slots=2, debug_poison=True),
                                         dict(dropless=True), 2, "F0 F1 B1 B0", 3, 0.0, 0),
    "ep2_arena_spill_poison": (2, dict(dropless_arena=True, capacity_factor=1.5, arena_region_factor=0.75,
                                       debug_poison=True), dict(dropless=True), 3, "F0 B0", 3, 0.25, 1),
    "ep2_mxfp8_cf1.0": (2, dict(mxfp8_dispatch=True, capacity_factor=1.0),
                        dict(mxfp8_dispatch=True, capacity_factor=1.0), 2, "F0 B0", 3, 0.25, 0),
    "ep4_put_return_cf1.0": (4, dict(capacity_factor=1.0, return_transfer="put", lease_slots=2),
                             dict(capacity_factor=1.0), 2, "F0 F1 B0 B1", 2, 0.25, 3),
    "ep2_arena_put_return": (2, dict(dropless_arena=True, capacity_factor=1.5, arena_region_factor=0.75,
                                     return_transfer="put"), dict(dropless=True), 2, "F0 B0", 2, 0.25, 1),
}
TOKENS, HIDDEN, FFN, EXPERTS, TOPK = 16, 32, 16, 8, 2

# name -> (EP ranks, MoEExtConfig settings, steps): megatron_ext.tiny_gpt (Megatron's GPTModel with
# the rowwise layers, Adam, gradient buckets) trained over the symm transport: the same losses,
# bitwise, as over the torch transport, and no host read in the MoE layers.
TRAINING_CASES = {
    "ep2_tiny_gpt_training": (2, dict(capacity_factor=1.0), 4),
}


def _rank(rank, world, peers, ext, case):
    import torch

    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import rank_tokens
    from tests.layer_check import run_and_compare

    def torch_transport_keep(layer):
        """The routes the torch transport's layer keeps on the same weights and tokens (its own count
        exchange, by gloo): the oracle's keep set, once the symm layer is shown to keep exactly those."""
        reference = moe_builder(MoEExtConfig(transport="torch", **_torch_settings(ext)))(config=layer.config)
        reference.load_state_dict(layer.state_dict())
        x, _ = rank_tokens(rank, case.tokens_of(rank), case.hidden, case.dtype)
        reference(x.view(-1, 1, case.hidden))
        kept, mine = reference.token_dispatcher.kept_route_mask(), layer.token_dispatcher.kept_route_mask()
        if not torch.equal(mine, kept):
            raise AssertionError(f"rank {rank}: the symm layer keeps {int(mine.sum())} routes, the torch transport's "
                                 f"{int(kept.sum())}; they differ at {int((mine != kept).sum())}")
        return kept

    def compare(heap):
        layers = []

        def build(config):
            layers.append(moe_builder(MoEExtConfig(transport="symm", **ext))(config=config))
            return layers[0]

        run_and_compare(rank, case, build, keep_of=torch_transport_keep)
        dispatcher = layers[0].token_dispatcher
        return dict(barriers=heap.barriers_passed, dropped=int((dispatcher.route_map.dest_row < 0).sum()),
                    transport=type(dispatcher.transport).__name__, pool=heap.bytes_used)

    # no late rank: run_and_compare's gloo all-gather after the step would hold the peers it waits for
    return peers.run_rank(rank, compare)


def _torch_settings(settings: dict) -> dict:
    """The settings without those of the symm transport alone."""
    return {key: value for key, value in settings.items() if key != "return_transfer"}


def _stack(world, transport, settings, layers, skew):
    import torch

    from megatron_ext.config import MoEExtConfig
    from megatron_ext.moe.arena import attach_arenas
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import load_weights, moe_config
    from megatron_ext.testing.reference import MoEWeights

    stack = torch.nn.ModuleList()
    for index in range(layers):
        # T_max given: no gloo all-reduce between the symm kernels (see compare in _stack_rank)
        layer = moe_builder(MoEExtConfig(transport=transport, max_tokens_per_rank=TOKENS, **settings))(
            config=moe_config(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, ep=world))
        weights = MoEWeights.random(EXPERTS, HIDDEN, FFN, seed=20 + index)
        weights.router[0] += skew
        load_weights(layer, weights)
        stack.append(layer)
    arenas = attach_arenas(stack)  # layers without dropless_arena are left alone
    return stack, arenas


def _run_schedule(stack, rank, schedule, steps, skew):
    """Per step: each microbatch's output and input gradient, then every weight gradient (summed over
    the step's microbatches); and the routes the layers dropped."""
    from megatron_ext.testing.megatron_moe import rank_tokens
    from megatron_ext.testing.moe_stack import stack_forward, stack_grads
    from megatron_ext.testing.threaded_peers import schedule_events

    results, dropped = [], 0
    for step in range(steps):
        for param in stack.parameters():
            param.grad = None
        inputs, outputs, grads = {}, {}, {}
        for kind, microbatch in schedule_events(schedule):
            if kind == "F":
                x, grads[microbatch] = rank_tokens(rank, TOKENS, HIDDEN, seed=1000 * step + 10 * microbatch)
                inputs[microbatch] = (x + skew).view(TOKENS, 1, HIDDEN).requires_grad_(True)
                outputs[microbatch] = stack_forward(stack, inputs[microbatch])
            else:
                outputs[microbatch].backward(grads[microbatch].view(TOKENS, 1, HIDDEN))
        for microbatch in sorted(outputs):
            results += [outputs[microbatch].detach(), inputs[microbatch].grad]
        results += stack_grads(stack)
        dropped += sum(layer.read_metrics()["dropped_routes"] for layer in stack)
    return results, dropped


def _stack_rank(rank, world, peers, name, late_rank, steps):
    import torch

    world, symm_settings, torch_settings, layers, schedule, case_steps, skew, _ = STACK_CASES[name]
    steps = steps or case_steps

    def compare(heap):
        # the torch transport's collectives first: a late rank waits for its peers to park at a symm
        # barrier or finish, and a peer blocked in a gloo collective would be neither
        want, want_dropped = _run_schedule(_stack(world, "torch", torch_settings, layers, skew)[0], rank, schedule,
                                           steps, skew)
        stack, arenas = _stack(world, "symm", symm_settings, layers, skew)
        got, dropped = _run_schedule(stack, rank, schedule, steps, skew)
        wrong = [] if len(got) == len(want) else [f"{len(got)} tensors, the torch transport's {len(want)}"]
        wrong += [f"tensor {index}: max err {float((a - b).abs().max()):.3g}, {int(torch.isnan(a).sum())} NaN"
                  for index, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
        return dict(wrong=wrong, dropped=(dropped, want_dropped), barriers=heap.barriers_passed, pool=heap.bytes_used,
                    transports={type(layer.token_dispatcher.transport).__name__ for layer in stack},
                    spilled=sum(int(arena.slots[0].cursors[-1].sum()) for arena in arenas), arena=bool(arenas))

    return peers.run_rank(rank, compare, late_rank=late_rank)


def _on_ranks(name: str, fn, world: int, *args):
    """`fn` on `world` forked EP ranks: their results, or None once a rank's error is reported."""
    from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, run_on_ranks
    from megatron_ext.testing.threaded_peers import report_case

    try:
        return run_on_ranks(fn, world, *args, sizes=ParallelSizes(ep=world))
    except RankFailure as error:
        report_case(name, [str(error)[-3000:]], "a rank raised")
        return None


def run_stack_case(name: str, late_rank: int | None, steps: int | None) -> bool:
    """True if the case failed (printed)."""
    from megatron_ext.testing.forked_peers import ForkedPeers
    from megatron_ext.testing.threaded_peers import report_case

    world, late_rank = STACK_CASES[name][0], STACK_CASES[name][-1] if late_rank is None else late_rank
    results = _on_ranks(name, _stack_rank, world, ForkedPeers(world), name, late_rank, steps)
    if results is None:
        return True
    failures = [f"rank {rank}: dropped {result['dropped'][0]} routes, the torch transport {result['dropped'][1]}"
                for rank, result in enumerate(results) if result["dropped"][0] != result["dropped"][1]]
    if min(result["barriers"] for result in results) == 0:
        failures.append("no rank passed a barrier")
    if set.union(*(result["transports"] for result in results)) != {"SymmRowTransport"}:
        failures.append(f"not the symm transport in every layer: {[r['transports'] for r in results]}")
    if results[0]["arena"] and not any(result["spilled"] for result in results):
        failures.append("the arena spilled nothing in the last step: its shared area was not exercised")
    failures += [f"rank {rank} {line}" for rank, result in enumerate(results) for line in result["wrong"]]
    summary = (f"EP={world}, late rank {late_rank}, barriers {[r['barriers'] for r in results]}, dropped "
               f"{[r['dropped'][0] for r in results]}, pool bytes {max(r['pool'] for r in results)}")
    return report_case(name, failures, summary)


def _training_rank(rank, world, peers, settings, steps, transport):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.tiny_gpt import TinyGPTConfig, train

    config = MoEExtConfig(transport=transport, **settings)
    if peers is None:
        return train(rank, world, TinyGPTConfig(), config, steps), 0
    # no late rank: the step's gloo collectives (gradient buckets, the loss) would hold the peers it waits for
    return peers.run_rank(rank, lambda heap: (train(rank, world, TinyGPTConfig(), config, steps),
                                              heap.barriers_passed))


def run_training_case(name: str) -> bool:
    """True if the case failed (printed)."""
    from megatron_ext.testing.forked_peers import ForkedPeers
    from megatron_ext.testing.threaded_peers import report_case

    world, settings, steps = TRAINING_CASES[name]
    got = _on_ranks(name, _training_rank, world, ForkedPeers(world), settings, steps, "symm")
    want = None if got is None else _on_ranks(name, _training_rank, world, None, settings, steps, "torch")
    if want is None:
        return True
    barriers = [rank_barriers for _, rank_barriers in got]
    failures = [] if min(barriers) > 0 else [f"a rank passed no symm barrier: {barriers}"]
    for rank, ((records, _), (reference, _)) in enumerate(zip(got, want)):
        losses, syncs = [r["loss"] for r in records], [r["moe_host_syncs"] for r in records]
        if losses != [r["loss"] for r in reference]:
            failures.append(f"rank {rank}: losses {losses} over symm, {[r['loss'] for r in reference]} over torch")
        if any(syncs):
            failures.append(f"rank {rank}: host reads in the MoE layers: {syncs}")
    losses = [round(record["loss"], 4) for record in got[0][0]]
    return report_case(name, failures, f"EP={world}, barriers {barriers}, losses {losses}")


def run_case(name: str) -> bool:
    """True if the case failed (printed)."""
    from megatron_ext.testing.forked_peers import ForkedPeers
    from megatron_ext.testing.threaded_peers import report_case
    from tests.layer_check import Case

    world, ext, case_settings = CASES[name]
    results = _on_ranks(name, _rank, world, ForkedPeers(world), ext, Case(**case_settings))
    if results is None:
        return True
    failures = []
    if {r["transport"] for r in results} != {"SymmRowTransport"}:
        failures.append(f"not the symm transport: {results}")
    if min(r["barriers"] for r in results) == 0:
        failures.append(f"no rank passed a barrier: {results}")
    if ext.get("capacity_factor") is not None and sum(r["dropped"] for r in results) == 0:
        failures.append("nothing dropped: the kept-routes comparison was not exercised")
    if ext.get("dropless") and sum(r["dropped"] for r in results):
        failures.append(f"routes dropped with dropless=True: {[r['dropped'] for r in results]}")
    summary = (f"EP={world}, barriers {[r['barriers'] for r in results]}, dropped {[r['dropped'] for r in results]}, "
               f"pool bytes {max(r['pool'] for r in results)}")
    return report_case(name, failures, summary)


def main() -> int:
    sys.path.insert(0, REPO)
    from tests.unit.interpreter import interpreter_ready, shard
    from tests.unit.symm_mutations import PHASES, drop_fences, unfence_poison

    if not interpreter_ready():
        return 2
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", choices=sorted({**CASES, **STACK_CASES, **TRAINING_CASES}))
    parser.add_argument("--shard", help="K/N: run every Nth case from the Kth")
    parser.add_argument("--late-rank", type=int, help="the stack cases' late rank (default: each case's own)")
    parser.add_argument("--steps", type=int, help="the stack cases' steps (default: each case's own)")
    parser.add_argument("--drop-barrier", choices=PHASES, action="append",
                        help="drop this phase's barrier on every rank (a mutation: the run must then fail); "
                             "given several times, the chosen cases run once per phase")
    parser.add_argument("--unfenced-poison", action="store_true", help="poison fills without their barrier (a "
                                                                         "mutation: the poisoned cases must fail)")
    args = parser.parse_args()
    if args.unfenced_poison:
        unfence_poison()
    dropped = set()
    drop_fences(lambda transport, phase: phase in dropped)  # read at each barrier of the ranks forked later
    failed = []
    for phase in args.drop_barrier or [None]:
        dropped.clear()
        if phase is not None:
            dropped.add(phase)
            print(f"-- without the {phase} barrier")
        failed += [run_stack_case(name, args.late_rank, args.steps) if name in STACK_CASES else
                   run_training_case(name) if name in TRAINING_CASES else run_case(name)
                   for name in shard(args.case or {**CASES, **STACK_CASES, **TRAINING_CASES}, args.shard)]
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
