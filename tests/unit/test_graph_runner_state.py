"""The graph runner's host-side state on CPU (cuda_graphs/runner.py): a refused slot leaves nothing
taken, a failed capture (or one rank's failed warm-up) becomes an agreed reason (peers are told,
leases come back) while a warm-up that fails at EP > 1 is raised (peers wait in its barriers),
release_cuda_graphs takes Megatron's list of model chunks, and router replay blocks capture."""

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


def test_all_slots_busy_names_the_setting():
    runner = _captured(GraphedMoELayer(_Layer(_Pool(2)), num_slots=2), 2)
    for slot in runner.slots:
        slot.busy = True
    with pytest.raises(RuntimeError, match="raise --moe-ext-lease-slots"):
        runner._acquire(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="or turn off --moe-ext-cuda-graphs"):
        runner._acquire(torch.zeros(3, 4))


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
