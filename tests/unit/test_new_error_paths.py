"""The failure modes added with the EP>1, faults and structure work: each a clear error, tested."""

import time
import types

import pytest
import torch

from megatron_ext import specs
from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.buffers import LeasePool, allocate_symmetric
from megatron_ext.moe.peer_failure import BarrierWatchdog


def test_te_specs_without_transformer_engine_name_the_local_setting(monkeypatch):
    monkeypatch.setattr(specs, "transformer_engine_available", lambda: False)
    with pytest.raises(ImportError, match=r"use_te=False.*megatron-ext\[te\]"):
        specs.gpt_layer_spec(4, use_te=True)


def test_ddp_buckets_is_refused_by_the_layer_builder():
    with pytest.raises(ValueError, match="install_folding_ddp"):
        specs.moe_builder(MoEExtConfig(ddp_buckets=True))


@pytest.mark.parametrize("value,error,match", [(0, ValueError, "peer_timeout_s must be > 0"),
                                               (float("inf"), ValueError, "peer_timeout_s must be > 0"),
                                               ("30", TypeError, "peer_timeout_s must be a number")])
def test_peer_timeout_is_validated(value, error, match):
    with pytest.raises(error, match=match):
        MoEExtConfig(peer_timeout_s=value)


def test_mxfp8_payload_of_another_shape_is_refused():
    from megatron_ext.formats.mxfp8 import packed_row_bytes
    from megatron_ext.moe.mxfp8_dispatch import MXFP8Payload, payload_fc1

    payload = MXFP8Payload(torch.zeros(8, packed_row_bytes(64), dtype=torch.uint8), 64, torch.float32)
    anchor = torch.zeros(()).expand(16, 64)  # rows of another dispatch
    with pytest.raises(ValueError, match="pass the dispatcher's output and its MXFP8Rows together"):
        payload_fc1(anchor, torch.zeros(2, 32, 64), torch.tensor([4, 8], dtype=torch.int32), payload)


def test_a_graph_slot_whose_lease_is_busy_is_an_error():
    pool = LeasePool([allocate_symmetric((4, 8), torch.float32, torch.device("cpu"), None) for _ in range(2)])
    pool.acquire(slot=1)
    assert pool.acquire().slot == 0  # the first free one
    with pytest.raises(RuntimeError, match="dispatch-buffer slot 1 of this MoE layer holds a live microbatch"):
        pool.acquire(slot=1)


class _Event:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_watchdog_names_the_overdue_phase_and_ends_the_process(monkeypatch, capsys):
    watchdog = BarrierWatchdog(timeout_s=0.05, group=None)
    watchdog._pending.extend([("dispatch", _Event(True), time.monotonic() - 1),
                              ("combine", _Event(False), time.monotonic() - 1)])
    assert watchdog.overdue() is None  # the dispatch barrier just completed: the combine's wait starts now
    time.sleep(0.1)
    assert watchdog.overdue() == "combine"  # the completed dispatch barrier was dropped
    exits = []
    monkeypatch.setattr("os._exit", exits.append)
    watchdog.fail("combine")
    assert exits == [1]
    assert "waited 0 s in the combine barrier" in capsys.readouterr().err
    fresh = BarrierWatchdog(timeout_s=60, group=None)
    fresh._pending.append(("dispatch", _Event(False), time.monotonic()))
    assert fresh.overdue() is None  # pending, but within the timeout


def test_watchdog_does_not_charge_a_barrier_for_the_ones_queued_before_it(monkeypatch):
    """A host that runs ahead enqueues barriers long before the device reaches them: each one's wait
    counts from when the one before it completed (a review's simulation: barriers completing 1 s
    apart, enqueued together, killed a healthy process at a 3 s timeout). A simulated clock: a
    loaded machine's sleep can overrun by more than the margins here."""
    from megatron_ext.moe import peer_failure

    clock = [1000.0]
    monkeypatch.setattr(peer_failure, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    watchdog = BarrierWatchdog(timeout_s=0.2, group=None)
    barriers = [_Event(False) for _ in range(3)]
    enqueued = clock[0] - 1.0  # all three enqueued a second ago, longer than the timeout
    watchdog._pending.extend([(f"barrier {i}", event, enqueued) for i, event in enumerate(barriers)])
    assert watchdog.overdue() == "barrier 0"  # the first one really has been pending for a second
    for i in range(2):  # the device reaches each barrier 0.1 s after the one before: healthy
        barriers[i].done = True
        assert watchdog.overdue() is None, f"barrier {i + 1} charged for the time before barrier {i} completed"
        clock[0] += 0.1
        assert watchdog.overdue() is None
    clock[0] += 0.15
    assert watchdog.overdue() == "barrier 2"  # now it has waited longer than the timeout itself


def test_watchdog_drops_every_barrier_that_completed_since_the_last_poll(monkeypatch):
    """Barriers completing between two polls are all dropped: the oldest pending one is what counts."""
    from megatron_ext.moe import peer_failure

    clock = [1000.0]
    monkeypatch.setattr(peer_failure, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    watchdog = BarrierWatchdog(timeout_s=0.2, group=None)
    watchdog._pending.extend([(f"barrier {i}", _Event(i < 2), clock[0]) for i in range(3)])
    assert watchdog.overdue() is None
    assert [phase for phase, _, _ in watchdog._pending] == ["barrier 2"]


def test_peer_timeout_follows_megatrons_distributed_timeout(monkeypatch):
    """Unset, the peer timeout is Megatron's --distributed-timeout-minutes (in seconds), else torch's
    default process-group timeout; a configured value wins."""
    import torch.distributed as dist
    from megatron.training import global_vars

    from megatron_ext.moe.peer_failure import peer_timeout_seconds

    monkeypatch.setattr(global_vars, "get_args", lambda: types.SimpleNamespace(distributed_timeout_minutes=7))
    assert peer_timeout_seconds() == 420.0
    assert peer_timeout_seconds(12.5) == 12.5

    def uninitialised():
        raise AssertionError("args is not initialized")

    monkeypatch.setattr(global_vars, "get_args", uninitialised)
    assert peer_timeout_seconds() == dist.distributed_c10d.default_pg_timeout.total_seconds()

def test_a_peer_failure_inside_an_enclosing_phase_keeps_the_inner_phase():
    """A collective that failed inside another named phase is reported once, by the phase that ran it:
    the enclosing phase lets PeerFailure through instead of wrapping it in its own name."""
    from megatron_ext.moe.peer_failure import PeerFailure, named_phase

    with pytest.raises(PeerFailure) as failure:
        with named_phase("CUDA-graph capture agreement", None, 60.0):
            with named_phase("route-count exchange", None):
                raise RuntimeError("Connection closed by peer")
    assert str(failure.value) == ("megatron_ext rowwise MoE: the route-count exchange failed on this rank (no process "
                                  "group): a peer of the group stopped (crashed, was killed, stalled or raised). "
                                  "Cause: RuntimeError: Connection closed by peer")


def test_the_kernels_barrier_bound_is_twice_the_watchdogs():
    """The device barrier's own trap fires after the watchdog, whose message names phase and group."""
    from megatron_ext.moe.transport.symm import SymmRowTransport

    assert SymmRowTransport(None, 8, timeout_s=1.5).timeout_ms == 3000
    assert SymmRowTransport(None, 8).timeout_ms == 0  # unbounded


def test_capture_failure_on_the_legacy_stream_says_how_to_build_ddp():
    """A capture failing on gradient accumulators made on the legacy stream names the fix."""
    from megatron_ext.cuda_graphs.capture import _hint

    error = RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking stream")
    hint = _hint(error)
    assert "DistributedDataParallel" in hint and "torch.cuda.stream(torch.cuda.Stream())" in hint
    assert _hint(RuntimeError("an unrelated failure")) == ""


def test_fused_route_map_refuses_experts_not_sharded_evenly_before_any_kernel():
    from megatron_ext.moe import fused_routes

    selection = fused_routes.Selection(routing_map=torch.zeros(8, 6, dtype=torch.bool),
                                       counts=torch.zeros(6, dtype=torch.int32),
                                       block_hist=torch.zeros(1, 6, dtype=torch.int32),
                                       nonfinite=torch.zeros((), dtype=torch.int32))
    table = torch.zeros(4, 6, dtype=torch.int32)  # 6 experts over 4 EP ranks
    with pytest.raises(ValueError, match="6 experts cannot be sharded over 4 EP ranks"):
        fused_routes.route(selection, 2, 16, gather_counts=lambda counts: table, ep_rank=0)
    with pytest.raises(ValueError, match="capacity must be >= 0 rows, got -1"):
        fused_routes.route(selection, 2, -1, gather_counts=lambda counts: table[:3], ep_rank=0)


def test_put_return_for_a_route_map_never_dispatched_says_why():
    """return_transfer='put' finds each row's way back from its dispatch: combine or dispatch
    backward on another route map is an error naming that, not a read of stale return ids."""
    from megatron_ext.moe.route_map import route
    from megatron_ext.moe.transport.symm import SymmRowTransport

    transport = SymmRowTransport(None, 16, return_put=True)
    undispatched = route(torch.tensor([[0, 1], [1, 0]]), num_experts=2, capacity=16)
    with pytest.raises(RuntimeError, match="combine for a route map this transport never dispatched"):
        transport.combine(torch.zeros(16, 8), undispatched)
    with pytest.raises(RuntimeError, match="dispatch backward for a route map this transport never dispatched"):
        transport.dispatch_backward(torch.zeros(16, 8), torch.zeros(16), undispatched)


def test_spill_arrays_not_laid_out_as_the_rows_are_refused():
    from megatron_ext.kernels.arena_spill import SpillArrays

    rows, values = torch.zeros(10, 4), torch.zeros(10)
    with pytest.raises(ValueError, match="activations have 9 view and 6 shared rows"):
        SpillArrays(rows, rows[:6], values, values[:6], view_act=torch.zeros(9, 2), shared_act=torch.zeros(6, 2))
    with pytest.raises(ValueError, match="return ids given for only one"):
        SpillArrays(rows, rows[:6], values, values[:6], view_ids=torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="values arrays must be contiguous"):
        SpillArrays(rows, rows[:6], torch.zeros(10, 2)[:, 0], values[:6])
    SpillArrays(rows, rows[:6], values, values[:6])  # laid out as the rows: accepted


def test_swiglu_out_of_another_shape_is_refused_on_cpu_too():
    from megatron_ext.kernels.swiglu import swiglu_forward

    h, valid = torch.randn(5, 8), torch.tensor(5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out must be a contiguous \[5, 4\]"):
        swiglu_forward(h, valid, None, out=torch.empty(4, 4))
    out = torch.full((5, 4), float("nan"))
    assert swiglu_forward(h, valid, None, out=out) is out and torch.isfinite(out).all()


def test_route_plan_takes_the_arena_cursor_or_capacities_not_both():
    from megatron_ext.kernels.route_plan import plan_and_place

    with pytest.raises(ValueError, match="the arena's cursor or dest_capacity, not both"):
        plan_and_place(torch.zeros(4, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.int32),
                       torch.zeros((), dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 1, 8, 0,
                       dest_capacity=torch.ones(1, dtype=torch.int64), arena=object())
