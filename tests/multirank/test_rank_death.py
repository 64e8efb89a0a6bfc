"""A rank dies or raises mid-step: the survivors stop with a message naming the phase, never hang.

gloo ranks, torch transport, EP=2. Rank 1 is killed (SIGKILL) right before its collective of a
phase in forward or backward, or raises between dispatch and combine (as a user hook would).
Rank 0 must end within the bound with megatron_ext's PeerFailure naming that phase and its group.
The symm transport's version (device barriers, 2 GPUs) is tests/gpu/test_rank_death_multigpu.py.
"""

import os
import signal
import time

import pytest

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, run_on_ranks
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights

BOUND_S = 60  # the survivor must report within this (gloo fails at once when a peer's socket closes)


def _layer(world):
    layer = moe_builder(MoEExtConfig(transport="torch"))(
        config=moe_config(hidden=32, ffn=16, experts=4, topk=2, ep=world))
    load_weights(layer, MoEWeights.random(4, 32, 16, seed=1))
    return layer


def _die_in(rank, world, phase, how):
    layer = _layer(world)
    transport_holder = layer.token_dispatcher
    x, g = rank_tokens(rank, 8, 32)
    out, _ = layer(x.view(8, 1, 32).requires_grad_(True))  # first step builds the transport
    out.backward(g.view_as(out))
    transport = transport_holder.transport
    exchange = transport._exchange

    def failing_exchange(send, name):
        if rank == 1 and name == phase:
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"a user hook raised on rank 1 before the {name}")
        return exchange(send, name)

    transport._exchange = failing_exchange
    start = time.monotonic()
    x_in = x.view(8, 1, 32).clone().requires_grad_(True)
    out, _ = layer(x_in)
    out.backward(g.view_as(out))
    return time.monotonic() - start


@pytest.mark.parametrize("phase", ["dispatch", "combine", "combine backward", "dispatch backward"])
@pytest.mark.parametrize("how", ["killed", "raised"])
def test_survivor_names_the_phase(phase, how):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_die_in, 2, phase, how, sizes=ParallelSizes(ep=2), timeout=BOUND_S, wait_all=True)
    report = str(failure.value)
    assert time.monotonic() - start < BOUND_S, "the survivor did not stop within the bound"
    assert "--- rank 0 of 2 ---" in report and "PeerFailure" in report, report[-3000:]
    assert f"the {phase} failed on rank 0 (global rank 0) of the expert-parallel group [0, 1]" in report, report[-3000:]
    if how == "killed":
        assert "rank 1 exited with code -9 without a result" in report, report[-2000:]
    else:
        assert "a user hook raised on rank 1" in report


def _die_before_first_forward(rank, world):
    layer = _layer(world)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x, _ = rank_tokens(rank, 8, 32)
    layer(x.view(8, 1, 32))  # the first forward agrees on the largest microbatch: one all-reduce


def test_survivor_names_the_first_forward_agreement():
    """The all-reduce of the first forward (T_max) is a wait on peers too: a review saw the survivor
    raise gloo's bare 'Connection reset by peer' there."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_die_before_first_forward, 2, sizes=ParallelSizes(ep=2), timeout=BOUND_S, wait_all=True)
    report = str(failure.value)
    assert "PeerFailure" in report and "the first-forward agreement on the largest microbatch failed on rank 0" \
        in report, report[-3000:]


def _name_a_failed_phase(rank, world):
    """A group of global rank 1 alone: its rank in the group (0) is not its global rank (1)."""
    import torch.distributed as dist

    from megatron_ext.moe.peer_failure import PeerFailure, named_phase

    group = dist.new_group([1])  # every rank creates it; only rank 1 is a member
    if rank != 1:
        return None
    messages = []
    for timeout_s in (90.0, None):
        try:
            with named_phase("combine", group, timeout_s):
                raise RuntimeError("Connection reset by peer")
        except PeerFailure as failure:
            messages.append(str(failure))
    return messages


def test_a_failed_phase_names_the_group_rank_the_global_rank_and_the_bound():
    """The message names this rank in the group and globally (different here: global rank 1 is rank 0
    of the group [1]) and, when there is one, the bound on the waits (90 s)."""
    _, (bounded, unbounded) = run_on_ranks(_name_a_failed_phase, 2, timeout=BOUND_S)
    where = "the combine failed on rank 0 (global rank 1) of the expert-parallel group [1]"
    assert where in bounded and where in unbounded, (bounded, unbounded)
    assert "stopped (crashed, was killed, stalled or raised) (waits are bounded by 90 s). Cause: RuntimeError: " \
           "Connection reset by peer" in bounded, bounded
    assert "raised). Cause: RuntimeError: Connection reset by peer" in unbounded, unbounded
