"""The graph runner's host-side state on CPU (cuda_graphs/runner.py): a refused slot leaves nothing
taken, a failed capture (or one rank's failed warm-up) becomes an agreed reason (peers are told,
leases come back) while a warm-up that fails at EP > 1 is raised (peers wait in its barriers),
release_cuda_graphs takes Megatron's list of model chunks, router replay blocks capture, and replays
(through stand-in graphs) hold slot, lease and arena slot from forward to backward and hand DDP's
parameters the static gradient buffer without a copy."""

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cuda_graphs import runner as runner_module
from megatron_ext.cuda_graphs.runner import GraphedMoELayer, capture_blockers, release_cuda_graphs


class _Pool:
    """A lease pool stand-in: slot `taken` is held by an eager microbatch."""

    def __init__(self, slots: int, taken: int | None = None):
        self.busy = [i == taken for i in range(slots)]
        self.released_all = False

    @property
    def live(self) -> int:
        return sum(self.busy)

    def acquire(self, slot: int):
        if self.busy[slot]:
            raise RuntimeError(f"dispatch-buffer slot {slot} of this MoE layer holds a live microbatch")
        self.busy[slot] = True
        return SimpleNamespace(release=lambda: self.busy.__setitem__(slot, False))

    def release_all(self):
        self.busy = [False] * len(self.busy)
        self.released_all = True


class _Layer(torch.nn.Module):
    def __init__(self, pool=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.ext_config = MoEExtConfig(lease_slots=2)
        self.token_dispatcher = SimpleNamespace(transport=SimpleNamespace(pool=pool), ep_size=1)

    def forward(self, x):
        return x @ self.weight, None


def _captured(runner, slots: int):
    graph = SimpleNamespace(reset=lambda: None)
    runner._take_trainable_params()  # as _capture_agreed does
    runner.slots = [SimpleNamespace(index=i, busy=False, lease=None, input=torch.zeros(2, 4), forward_graph=graph,
                                    backward_graph=graph) for i in range(slots)]
    return runner


def test_a_refused_lease_leaves_the_graph_slot_free():
    pool = _Pool(2, taken=0)
    runner = _captured(GraphedMoELayer(_Layer(pool), num_slots=2), 2)
    with pytest.raises(RuntimeError, match="slot 0 of this MoE layer holds a live microbatch"):
        runner._acquire(torch.zeros(2, 4))
    assert not runner.slots[0].busy, "a slot marked busy by a refused acquire would stay busy for good"
    pool.busy[0] = False
    assert runner._acquire(torch.zeros(2, 4)) is runner.slots[0] and pool.busy == [True, False]


def test_a_refused_arena_slot_gives_the_lease_back(monkeypatch):
    pool = _Pool(2)
    runner = _captured(GraphedMoELayer(_Layer(pool), num_slots=2), 2)

    def refuse(arena, index):
        raise RuntimeError("another arena slot is open")
    monkeypatch.setattr(runner_module.arena_slots, "acquire", refuse)
    with pytest.raises(RuntimeError, match="another arena slot is open"):
        runner._acquire(torch.zeros(2, 4))
    assert pool.busy == [False, False] and not runner.slots[0].busy


def test_the_runner_needs_a_slot_and_a_warm_up_step():
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        GraphedMoELayer(_Layer(), num_slots=0)
    with pytest.raises(ValueError, match="warmup_iters must be >= 1, got 0"):
        GraphedMoELayer(_Layer(), num_slots=1, warmup_iters=0)


def test_all_slots_busy_names_the_setting():
    runner = _captured(GraphedMoELayer(_Layer(_Pool(2)), num_slots=2), 2)
    for slot in runner.slots:
        slot.busy = True
    with pytest.raises(RuntimeError, match="raise --moe-ext-lease-slots"):
        runner._acquire(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="or turn off --moe-ext-cuda-graphs"):
        runner._acquire(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"captured for input \(2, 4\) torch.float32, got \(2, 4\) torch.float64"):
        runner._acquire(torch.zeros(2, 4, dtype=torch.float64))  # a copy into the static input would cast


def _failing(monkeypatch, runner, pool, phase: str, ep_group):
    """`phase` ("_warm_up" or "_capture") runs out of memory after taking a lease; returns the all-reduces."""
    reduced = []

    def out_of_memory(sample):
        pool.busy[0] = True  # a forward took a lease; its backward never ran
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if phase == "_capture":
        monkeypatch.setattr(runner, "_warm_up", lambda sample: None)
    monkeypatch.setattr(runner, phase, out_of_memory)
    monkeypatch.setattr(runner_module, "ep_group_of", lambda layer: ep_group)
    monkeypatch.setattr(runner_module.dist, "all_reduce", lambda tensor, op, group: reduced.append(int(tensor.item())))
    return reduced


@pytest.mark.parametrize("phase,ep_group", [("_capture", None), ("_capture", "peers"), ("_warm_up", None)])
def test_a_failed_capture_is_a_reason_every_rank_hears(monkeypatch, phase, ep_group):
    pool = _Pool(2)
    runner = GraphedMoELayer(_Layer(pool), num_slots=2)
    reduced = _failing(monkeypatch, runner, pool, phase, ep_group)
    reason = runner._capture_agreed(torch.zeros(2, 4))
    assert reason.startswith("warm-up or capture failed: OutOfMemoryError: CUDA out of memory"), reason
    assert pool.released_all and pool.busy == [False, False] and runner.slots is None
    assert reduced == ([0] if ep_group else []), "peers must learn that this rank did not capture"


def test_a_failed_warm_up_at_ep_above_one_is_raised_not_agreed(monkeypatch):
    """The peers ran the same eager steps and wait in a device barrier this rank never reaches; an
    all-reduce would never complete (a review's simulation: both ranks hung)."""
    pool = _Pool(2)
    runner = GraphedMoELayer(_Layer(pool), num_slots=2)
    reduced = _failing(monkeypatch, runner, pool, "_warm_up", "peers")
    with pytest.raises(runner_module.WarmUpFailed, match=r"failed on this rank \(OutOfMemoryError: CUDA out of "
                                                         r"memory.*peer timeout \(--moe-ext-peer-timeout-s\)"):
        runner._capture_agreed(torch.zeros(2, 4))
    assert reduced == [] and pool.released_all and pool.busy == [False, False]


def test_capture_needs_an_idle_layer():
    runner = GraphedMoELayer(_Layer(_Pool(2, taken=1)), num_slots=2)
    assert runner._capture_agreed(torch.zeros(2, 4)) == ("capture failed: 1 dispatch-buffer slot(s) hold live "
                                                         "microbatches at capture time; capture needs the layer idle")
    assert runner.slots is None


def test_release_cuda_graphs_takes_a_module_or_megatrons_chunk_list():
    chunks = []
    for _ in range(2):
        chunk = torch.nn.Sequential(_Layer())
        chunk[0]._graph_runner = _captured(GraphedMoELayer(chunk[0], num_slots=1), 1)
        chunks.append(chunk)
    assert release_cuda_graphs(chunks) == 2 and all(c[0]._graph_runner.slots is None for c in chunks)
    _captured(chunks[0][0]._graph_runner, 1)
    assert release_cuda_graphs(chunks[0]) == 1 and release_cuda_graphs(chunks) == 0
    bare = _Layer()  # a module that is no container
    bare._graph_runner = _captured(GraphedMoELayer(bare, num_slots=1), 1)
    assert release_cuda_graphs(bare) == 1 and bare._graph_runner.slots is None
    chunks[1][0]._graph_runner.slots = None
    _captured(chunks[1][0]._graph_runner, 1).slots[0].busy = True
    with pytest.raises(RuntimeError, match="run the backward of every forward first"):
        release_cuda_graphs(chunks)


def test_router_replay_blocks_capture():
    layer = _Layer()
    layer.router = SimpleNamespace(router_replay=object())
    assert any("router replay" in reason for reason in capture_blockers(layer, torch.zeros(2, 4)))
    layer.router.router_replay = None
    assert not any("router replay" in reason for reason in capture_blockers(layer, torch.zeros(2, 4)))


def test_a_moved_main_grad_drops_the_graphs_at_the_next_call(monkeypatch):
    """Through __call__: DDP re-created a main_grad since capture -> one rank drops its graphs (and,
    on this CPU, runs eagerly); at EP > 1 the call stops and names release_cuda_graphs."""
    layer = _Layer()
    layer.weight.main_grad = torch.zeros(4, 4)
    runner = _captured(GraphedMoELayer(layer, num_slots=1), 1)
    runner.main_grad_params = [layer.weight]
    runner._main_grad_addresses = [layer.weight.main_grad.data_ptr()]
    x = torch.randn(2, 4)
    monkeypatch.setattr(runner_module, "ep_group_of", lambda layer: "peers")
    layer.weight.main_grad = torch.zeros(4, 4)  # offload / restore: a new buffer
    with pytest.raises(RuntimeError, match="release_cuda_graphs"):
        runner(x)
    assert runner.slots is not None, "at EP > 1 no rank drops its graphs alone"
    monkeypatch.setattr(runner_module, "ep_group_of", lambda layer: None)
    out, _ = runner(x)
    assert runner.slots is None and runner.main_grad_params == [] and torch.equal(out, x @ layer.weight)


def _replayable(runner, layer, slots: int):
    """Captured slots whose 'graphs' compute x @ weight and its gradients into static buffers, as
    the CUDA graphs would (forward: output; backward: the input's and the weight's gradients)."""
    runner._take_trainable_params()
    runner.slots = []
    for index in range(slots):
        slot = SimpleNamespace(index=index, busy=False, lease=None, input=torch.zeros(2, 4), output=torch.zeros(2, 4),
                               grad_output=torch.zeros(2, 4), grads=[torch.zeros(2, 4), torch.zeros(4, 4)])

        def forward(s=slot):
            s.output.copy_(s.input @ layer.weight.detach())

        def backward(s=slot):
            s.grads[0].copy_(s.grad_output @ layer.weight.detach().t())
            s.grads[1].copy_(s.input.t() @ s.grad_output)
        slot.forward_graph = SimpleNamespace(replay=forward, reset=lambda: None)
        slot.backward_graph = SimpleNamespace(replay=backward, reset=lambda: None)
        runner.slots.append(slot)
    runner._static_grad_storage = {slot.grads[1].untyped_storage().data_ptr() for slot in runner.slots}
    return runner


def test_replays_hold_their_slot_lease_and_arena_slot_from_forward_to_backward():
    """1F1B on two slots: F0 F1 B0 F2 B1 B2. Each replay takes graph slot, lease and arena slot of
    the same index; its backward gives all three back, so F2 reuses slot 0."""
    from megatron_ext.moe.arena import ArenaLayer, RowArena

    arena = RowArena(2, 1.5, 1.0, lease_slots=2)
    arena.configure(16, 2)
    arena.allocate(None, 2, 0, 8, torch.float32, "cpu")
    pool, layer = _Pool(2), _Layer()
    layer.token_dispatcher = SimpleNamespace(transport=SimpleNamespace(pool=pool), ep_size=1,
                                             arena_layer=ArenaLayer(arena, 0))
    runner = _replayable(GraphedMoELayer(layer, num_slots=2), layer, 2)
    xs = [torch.randn(2, 4, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(2, 4) for _ in range(3)]
    out0, bias = runner(xs[0])
    out1, _ = runner(xs[1])
    assert bias is None and torch.allclose(out0, xs[0] @ layer.weight) and torch.allclose(out1, xs[1] @ layer.weight)
    assert [s.busy for s in runner.slots] == [True, True] and pool.busy == [True, True]
    assert [s.busy for s in arena.slots] == [True, True] and arena.current is arena.slots[1]
    out0.backward(grads[0])
    assert [s.busy for s in runner.slots] == [False, True] and pool.busy == [False, True]
    assert [s.busy for s in arena.slots] == [False, True] and runner.slots[0].lease is None
    torch.testing.assert_close(xs[0].grad, grads[0] @ layer.weight.detach().t())
    out2, _ = runner(xs[2])
    assert runner.slots[0].busy and pool.busy == [True, True] and arena.current is arena.slots[0]
    out1.backward(grads[1])
    out2.backward(grads[2])
    assert pool.busy == [False, False] and not any(s.busy for s in runner.slots + arena.slots)
    expected = sum(x.detach().t() @ g for x, g in zip(xs, grads))
    torch.testing.assert_close(layer.weight.grad, expected)
    assert layer.weight.grad.untyped_storage().data_ptr() not in runner._static_grad_storage, \
        "without DDP's hook nothing consumes param.grad: autograd must hold its own copy"


def test_under_ddp_the_static_gradient_goes_as_an_alias_and_is_copied_out_before_the_next_replay():
    """hand_over: a parameter with grad_added_to_main_grad (Megatron's DDP) gets the slot's static
    buffer itself (no copy); the captured backward's flags are set after the replay; a param.grad
    still aliasing the buffer at the next replay gets its own copy first (_unalias_param_grads)."""
    layer = _Layer()
    layer.weight.grad_added_to_main_grad, layer.weight.main_grad = False, torch.zeros(4, 4)
    runner = _replayable(GraphedMoELayer(layer, num_slots=1), layer, 1)
    runner.main_grad_params, runner._main_grad_addresses = [layer.weight], [layer.weight.main_grad.data_ptr()]
    x, grad = torch.randn(2, 4), torch.randn(2, 4)
    runner(x)[0].backward(grad)
    static = runner.slots[0].grads[1]
    assert layer.weight.grad.data_ptr() == static.data_ptr(), "DDP's parameters take the static buffer uncopied"
    assert layer.weight.grad_added_to_main_grad is True, "a replay sets the flag the captured backward set"
    kept = static.clone()
    out, _ = runner(torch.randn(2, 4))  # no hook consumed the alias: it is copied out before the replay
    assert layer.weight.grad.untyped_storage().data_ptr() not in runner._static_grad_storage
    assert torch.equal(layer.weight.grad, kept)
    own = layer.weight.grad
    runner._unalias_param_grads()
    assert layer.weight.grad is own, "a gradient of its own is left as it is"
    out.backward(grad)
    assert not torch.equal(layer.weight.grad, kept)


class _TorchTransport:
    """Runs NCCL collectives in the layer (no gather_counts)."""
    pool = None


def _agreeing(monkeypatch, runner, peer_captured: int):
    """EP = 2: this rank warms up and captures (stand-ins); the peer reports `peer_captured`."""
    seen = []

    def all_reduce(tensor, op, group):
        peer = torch.tensor([peer_captured], dtype=tensor.dtype)
        seen.append(op)
        tensor.copy_(torch.minimum(tensor, peer) if op == torch.distributed.ReduceOp.MIN else
                     torch.maximum(tensor, peer))
    monkeypatch.setattr(runner, "_warm_up", lambda sample: None)
    monkeypatch.setattr(runner, "_capture", lambda sample: _captured(runner, runner.num_slots))
    monkeypatch.setattr(runner_module, "ep_group_of", lambda layer: "peers")
    monkeypatch.setattr(runner_module.dist, "all_reduce", all_reduce)
    return seen


@pytest.mark.parametrize("peer_captured", [1, 0])
def test_ranks_replay_only_if_every_rank_captured(monkeypatch, peer_captured):
    layer = _Layer(_Pool(2))
    layer.token_dispatcher.ep_size, layer.token_dispatcher.transport.gather_counts = 2, None  # symm-like
    runner = GraphedMoELayer(layer, num_slots=2)
    seen = _agreeing(monkeypatch, runner, peer_captured)
    reason = runner._capture_agreed(torch.zeros(2, 4))
    assert seen == [torch.distributed.ReduceOp.MIN]
    if peer_captured:
        assert reason is None and len(runner.slots) == 2
    else:
        assert reason == "capture failed on another rank of the expert-parallel group (all ranks run eagerly)"
        assert runner.slots is None, "this rank's graphs are dropped when a peer could not capture"


def test_a_transport_with_nccl_in_the_layer_is_not_captured_at_ep_above_one(monkeypatch):
    layer = _Layer()
    layer.token_dispatcher = SimpleNamespace(transport=_TorchTransport(), ep_size=2)
    assert runner_module.transport_blocker(layer) == (
        "the _TorchTransport runs NCCL collectives inside the layer; a CUDA graph holding them keeps "
        "destroy_process_group from returning (pytorch/pytorch#115388): use --moe-ext-transport symm for graphs "
        "at EP > 1")
    runner = GraphedMoELayer(layer, num_slots=1)
    seen = _agreeing(monkeypatch, runner, 1)
    monkeypatch.setattr(runner, "_capture", lambda sample: pytest.fail("captured a transport that runs NCCL"))
    assert runner._capture_agreed(torch.zeros(2, 4)).startswith("the _TorchTransport runs NCCL collectives")
    assert seen == [torch.distributed.ReduceOp.MIN] and runner.slots is None, "the peers hear of it"
    layer.token_dispatcher.transport.gather_counts = None  # the symm transport exchanges counts itself
    assert runner_module.transport_blocker(layer) is None
    layer.token_dispatcher = SimpleNamespace(transport=_TorchTransport(), ep_size=1)
    assert runner_module.transport_blocker(layer) is None, "at EP = 1 the torch transport runs no collective"
    # a layer without a dispatcher, or one that does not say its EP size, runs no collective of its own
    assert runner_module.transport_blocker(torch.nn.Linear(1, 1)) is None
    layer.token_dispatcher = SimpleNamespace(transport=_TorchTransport())
    assert runner_module.transport_blocker(layer) is None


def _graphed_layer_rank(rank, world):
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import moe_config

    layer = moe_builder(MoEExtConfig(transport="torch", cuda_graphs=True, lease_slots=3))(config=moe_config(
        hidden=32, ffn=16, experts=4, topk=2, ep=1))
    runner, x = layer._graph_runner, torch.randn(8, 1, 32)
    seen = [runner.num_slots]
    layer.eval()
    layer(x)
    seen.append(runner.eager_reason)  # evaluation runs eagerly without asking the runner
    layer.train()
    with torch.no_grad():
        layer(x)
    seen.append(runner.eager_reason)
    layer(x.requires_grad_(True))[0].sum().backward()
    seen.append(runner.eager_reason)  # a training forward goes to the runner: on CPU it falls back
    return seen


def test_the_layer_hands_training_forwards_to_a_runner_with_one_slot_per_lease():
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    (seen,) = run_on_ranks(_graphed_layer_rank, 1, sizes=ParallelSizes())
    assert seen[:3] == [3, None, None], seen
    assert seen[3] == "the input is on cpu, CUDA graphs need a GPU", seen


def test_the_layer_keeps_forwards_with_megatrons_extra_arguments_eager_and_says_so_once(caplog):
    from megatron_ext.moe.layer import RowwiseMoELayer

    calls = []
    layer = SimpleNamespace(config=SimpleNamespace(), training=True, _graph_runner=lambda h: calls.append("runner"),
                            eager_forward=lambda h, i, p: calls.append(("eager", i, p)))
    x = torch.randn(4, 1, 8, requires_grad=True)
    with caplog.at_level("WARNING", logger="megatron_ext.moe.layer"):
        RowwiseMoELayer.forward(layer, x)
        assert not caplog.records
        RowwiseMoELayer.forward(layer, x, padding_mask="mask")
        RowwiseMoELayer.forward(layer, x, intermediate_tensors="tensors")
    assert calls == ["runner", ("eager", None, "mask"), ("eager", "tensors", None)]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "with a padding_mask or intermediate_tensors run the MoE layer eagerly" in said[0], said


def test_a_moved_main_grad_with_one_of_two_slots_live_names_the_move():
    layer = _Layer()
    layer.weight.main_grad = torch.zeros(4, 4)
    runner = _captured(GraphedMoELayer(layer, num_slots=2), 2)
    runner.main_grad_params, runner._main_grad_addresses = [layer.weight], [layer.weight.main_grad.data_ptr()]
    runner.slots[1].busy = True  # 1F1B: one microbatch is between its forward and its backward
    layer.weight.main_grad = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="main_grad of parameters .* moved since capture .* while microbatches are "
                                           "live in the graphs; re-create the buffers between iterations"):
        runner(torch.zeros(2, 4))
    assert runner.slots is not None


def test_the_trainable_parameters_are_taken_at_capture_not_when_the_runner_is_built(monkeypatch):
    """Megatron's --freeze-all-layers freezes after build_model: the warm-up and the captured
    backward differentiate what is trainable at capture (a review found the build-time list, whose
    frozen weight made autograd.grad raise and, at EP > 1, stop every rank with WarmUpFailed)."""
    layer = _Layer()
    runner = GraphedMoELayer(layer, num_slots=1)
    layer.weight.requires_grad_(False)
    differentiated = []
    monkeypatch.setattr(runner, "_warm_up", lambda sample: differentiated.append(list(runner.params)))
    monkeypatch.setattr(runner, "_capture", lambda sample: _captured(runner, 1))
    assert runner._capture_agreed(torch.zeros(2, 4, requires_grad=True)) is None
    assert differentiated == [[]] and runner.params == []


@pytest.mark.parametrize("change", ["unfrozen", "frozen"])
def test_a_parameter_frozen_or_unfrozen_since_capture_drops_the_graphs(monkeypatch, change):
    """Staged unfreezing: a weight trainable only after capture would get no gradient from the
    captured backward (silently). One rank captures again (on this CPU: runs eagerly, the weight's
    gradient as eager gives it); at EP > 1, or with a microbatch live, the call stops and says why."""
    layer = _Layer()
    layer.weight.requires_grad_(change == "frozen")
    runner = _replayable(GraphedMoELayer(layer, num_slots=1), layer, 1)
    layer.weight.requires_grad_(change == "unfrozen")
    x = torch.randn(2, 4, requires_grad=True)
    runner.slots[0].busy = True
    with pytest.raises(RuntimeError, match="frozen or unfrozen since its CUDA graphs were captured .* while "
                                           "microbatches are live in the graphs; change requires_grad between"):
        runner(x)
    runner.slots[0].busy = False
    monkeypatch.setattr(runner_module, "ep_group_of", lambda layer: "peers")
    with pytest.raises(RuntimeError, match="at EP > 1 call megatron_ext.cuda_graphs.release_cuda_graphs"):
        runner(x)
    assert runner.slots is not None, "at EP > 1 no rank drops its graphs alone"
    monkeypatch.setattr(runner_module, "ep_group_of", lambda layer: None)
    out, _ = runner(x)
    assert runner.slots is None, "dropped, to be captured again"
    out.sum().backward()
    if change == "unfrozen":
        torch.testing.assert_close(layer.weight.grad, x.detach().t() @ torch.ones(2, 4))
    else:
        assert layer.weight.grad is None
    torch.testing.assert_close(x.grad, torch.ones(2, 4) @ layer.weight.detach().t())


def test_a_forward_with_nothing_to_differentiate_runs_eagerly_and_takes_no_slot():
    """A frozen layer whose input needs no gradient: a replay's output would need none either, so its
    backward (which frees the slot, lease and arena slot) would never run and the next microbatch
    would find every slot taken. It runs eagerly, where the dispatcher keeps its backward."""
    layer = _Layer(_Pool(1))
    layer.ext_config = MoEExtConfig(lease_slots=1)
    layer.weight.requires_grad_(False)
    runner = _replayable(GraphedMoELayer(layer, num_slots=1), layer, 1)
    for _ in range(3):
        x = torch.randn(2, 4)
        out, _ = runner(x)
        assert torch.equal(out, x @ layer.weight) and not runner.slots[0].busy
        assert layer.token_dispatcher.transport.pool.busy == [False]
    out, _ = runner(torch.randn(2, 4, requires_grad=True))  # a gradient to the input: replayed
    assert runner.slots[0].busy
    out.sum().backward()
    assert not runner.slots[0].busy


class _LayerWithRouter(_Layer):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return x @ self.weight + self.router, None


def test_a_replay_flags_only_the_parameters_whose_captured_backward_added_to_main_grad():
    """Under DDP every trainable parameter carries grad_added_to_main_grad; a replay sets it only on
    those the captured backward added to main_grad itself (the experts' weights). A parameter whose
    gradient goes through autograd (the router's) must stay unflagged, or DDP's hook drops it."""
    layer = _LayerWithRouter()
    for param in (layer.weight, layer.router):
        param.grad_added_to_main_grad, param.main_grad = False, torch.zeros_like(param)
    runner = _replayable(GraphedMoELayer(layer, num_slots=1), layer, 1)
    slot = runner.slots[0]
    slot.grads.append(torch.zeros(4))  # the router's static gradient
    weight_backward = slot.backward_graph.replay

    def backward():
        weight_backward()
        slot.grads[2].copy_(slot.grad_output.sum(0))
    slot.backward_graph = SimpleNamespace(replay=backward, reset=lambda: None)
    runner.main_grad_params, runner._main_grad_addresses = [layer.weight], [layer.weight.main_grad.data_ptr()]
    x, grad = torch.randn(2, 4), torch.randn(2, 4)
    runner(x)[0].backward(grad)
    assert layer.weight.grad_added_to_main_grad is True
    assert layer.router.grad_added_to_main_grad is False, "the router's gradient must reach DDP's hook"
    torch.testing.assert_close(layer.router.grad, grad.sum(0))
