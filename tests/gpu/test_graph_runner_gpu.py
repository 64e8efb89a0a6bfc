"""Graph runner on one H200: replay equals eager for 1, 2 and 4 live microbatches; one shared
slot would corrupt two live microbatches, the runner's slots do not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, megatron_ddp, moe_config
from megatron_ext.testing.reference import MoEWeights, assert_close

pytestmark = pytest.mark.gpu
SHAPE = dict(hidden=1024, ffn=512, experts=16, topk=4)


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()


@pytest.fixture(scope="module")
def weights():
    return MoEWeights.random(SHAPE["experts"], SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)


def make_layer(weights, **ext):
    config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32")
    layer = moe_builder(MoEExtConfig(transport="symm", **ext))(config=config).cuda()
    load_weights(layer, weights)
    return layer


def microbatch(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1024, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
    return x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16()


def run_pipelined(layer, batches):
    """All forwards, then the backwards in reverse (the worst case for live slots)."""
    for p in layer.parameters():
        p.grad = None
    xs = [x.clone().requires_grad_(True) for x, _ in batches]
    outs = [layer(x)[0] for x in xs]
    for out, (_, g) in reversed(list(zip(outs, batches))):
        out.backward(g)
    return ([o.detach().float() for o in outs], [x.grad.float() for x in xs],
            layer.experts.fc1_weight.grad.float().clone())


@pytest.mark.parametrize("live", [1, 2, 4])
def test_replay_equals_eager_with_live_microbatches(weights, live):
    eager_layer = make_layer(weights, lease_slots=live)
    graphed_layer = make_layer(weights, lease_slots=live, cuda_graphs=True)
    for step in range(3):  # new inputs and routes every step
        batches = [microbatch(100 * step + i) for i in range(live)]
        eager = run_pipelined(eager_layer, batches)
        graphed = run_pipelined(graphed_layer, batches)
        assert graphed_layer._graph_runner.eager_reason is None, graphed_layer._graph_runner.eager_reason
        for i in range(live):
            assert torch.equal(graphed[0][i], eager[0][i]), f"step {step} microbatch {i} output"
            assert torch.equal(graphed[1][i], eager[1][i]), f"step {step} microbatch {i} input grad"
        assert_close(graphed[2], eager[2], rtol=1e-2, what=f"step {step} fc1 weight grad (summed over microbatches)")
    # The replayed route launches add into the same running sums as eager (warm-up and capture do not count).
    graphed_metrics, eager_metrics = graphed_layer.read_metrics(), eager_layer.read_metrics()
    assert graphed_metrics["steps"] == 3 * live, graphed_metrics["steps"]
    assert graphed_metrics == eager_metrics, (graphed_metrics, eager_metrics)


def test_one_f_one_b_order_equals_eager(weights):
    """A pipeline's steady state replays a slot's backward while another slot is live (F0 F1 B0 F0
    B1 B0): no slot's graphs may reuse memory another slot still needs, whatever the capture order."""
    eager_layer = make_layer(weights, lease_slots=2)
    graphed_layer = make_layer(weights, lease_slots=2, cuda_graphs=True)
    batches = [microbatch(500 + i) for i in range(3)]

    def one_f_one_b(layer):
        for p in layer.parameters():
            p.grad = None
        xs = [x.clone().requires_grad_(True) for x, _ in batches]
        outs, values = [], []

        def forward(i):  # a replay's output is its slot's buffer until the slot's next replay: read it now
            outs.append(layer(xs[i])[0])
            values.append(outs[-1].detach().float())

        forward(0)
        forward(1)
        outs[0].backward(batches[0][1])
        forward(2)  # slot 0 again
        outs[1].backward(batches[1][1])
        outs[2].backward(batches[2][1])
        return values, [x.grad.float() for x in xs]

    for step in range(2):  # the first step captures, the second only replays
        want, got = one_f_one_b(eager_layer), one_f_one_b(graphed_layer)
        assert graphed_layer._graph_runner.eager_reason is None, graphed_layer._graph_runner.eager_reason
        for i in range(3):
            assert torch.equal(got[0][i], want[0][i]), f"step {step} microbatch {i} output"
            assert torch.equal(got[1][i], want[1][i]), f"step {step} microbatch {i} input grad"


def test_one_shared_slot_corrupts_two_live_microbatches(weights):
    """What the report saw under pipeline parallelism: one graph per layer, two microbatches."""
    from megatron_ext.cuda_graphs.runner import _ReplaySlot

    shared = make_layer(weights, lease_slots=2, cuda_graphs=True)
    batches = [microbatch(7), microbatch(8)]
    run_pipelined(shared, batches[:1])  # captures 2 slots
    runner = shared._graph_runner
    first_slot = runner.slots[0]
    runner._acquire = lambda hidden: first_slot  # force both microbatches into one slot
    xs = [x.clone().requires_grad_(True) for x, _ in batches]
    outs = [_ReplaySlot.apply(x, runner, first_slot, *runner.params) for x in xs]
    first_output = outs[0].clone()
    eager = run_pipelined(make_layer(weights, lease_slots=2), batches)
    assert not torch.equal(first_output.float(), eager[0][0]), "the shared slot should have been overwritten"


def _sync_while_capturing(module, inputs, output):
    """A router hook that reads the device on the host, but only during capture: the capture fails."""
    if torch.cuda.is_current_stream_capturing():
        output[0].sum().item()


def _train_steps(layer, batches):
    results = []
    for x, g in batches:
        results.append(run_pipelined(layer, [(x, g)]))
    return results


def test_failed_capture_falls_back_to_eager_and_leaves_the_process_usable(weights, caplog):
    graphed = make_layer(weights, cuda_graphs=True)
    eager = make_layer(weights)
    graphed.router.register_forward_hook(_sync_while_capturing)
    batches = [microbatch(40 + i) for i in range(3)]
    with caplog.at_level("WARNING"):
        got = _train_steps(graphed, batches)
    reason = graphed._graph_runner.eager_reason
    assert reason is not None and "capture failed" in reason, reason
    assert any("runs eagerly" in r.getMessage() for r in caplog.records), "the fallback was not logged"
    want = _train_steps(eager, batches)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][0], b[1][0]), f"eager fallback step {step} differs"
    torch.cuda.empty_cache()  # aborted the process when the allocator still counted a capture underway
    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(1)
    assert int(scratch[-1]) == 1
    fresh = make_layer(weights, cuda_graphs=True)  # a later capture in the same process works
    run_pipelined(fresh, batches[:1])
    assert fresh._graph_runner.eager_reason is None, fresh._graph_runner.eager_reason


def test_capture_replay_raises_capture_failed_on_a_host_sync():
    from megatron_ext.cuda_graphs.capture import CaptureFailed
    from megatron_ext.host_sync import capture_replay

    x = torch.ones(8, device="cuda")

    def step():
        y = x * 2
        if torch.cuda.is_current_stream_capturing():
            y.sum().item()
        return y

    with pytest.raises(CaptureFailed):
        capture_replay(step)
    graph, out = capture_replay(lambda: x * 3)  # the process and its allocator still work
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 3))


def test_capture_replay_sees_a_sync_of_another_thread_in_the_backward():
    """The capture's thread_local mode lets the autograd device thread synchronize another stream (a
    review captured such a backward without error); the profiled warm-up step catches it."""
    from megatron_ext.host_sync import HostSyncFound, capture_replay
    from megatron_ext.testing.sync_probes import doubling_with_backward_action

    x = torch.ones(8, device="cuda", requires_grad=True)

    def step():
        x.grad = None
        doubling_with_backward_action(x, lambda grad: torch.cuda.default_stream().synchronize()).sum().backward()

    with pytest.raises(HostSyncFound, match="blocking CUDA calls"):
        capture_replay(step)


def test_capture_replay_keeps_what_the_step_reads_alive():
    """A caller that keeps only the graph must not lose the modules its replays read (a bench did:
    its collected layers' memory went back to the driver, and a replay hit an illegal address)."""
    import functools
    import gc
    import weakref

    from megatron_ext.host_sync import capture_replay

    linear = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda")
    want = linear(x).detach()
    alive = weakref.ref(linear)
    graph, out = capture_replay(functools.partial(linear, x))
    del linear
    gc.collect()
    torch.cuda.empty_cache()
    assert alive() is not None, "the module was collected while its graph can still replay"
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(7)  # would take freed memory
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_garbage_collection_cannot_run_inside_a_capture():
    """Earlier objects freed by a collection during a capture may call CUDA (here: a synchronize,
    as a communicator's destroy does); the capture keeps the collector off, so it succeeds.
    Fails without that: the collection runs at the first allocation past the threshold."""
    import gc

    from megatron_ext.cuda_graphs.capture import capture

    class SyncsWhenCollected:
        def __init__(self):
            self.cycle = self

        def __del__(self):
            torch.cuda.synchronize()

    x = torch.ones(8, device="cuda")

    def body():  # torch.cuda.graph collects on entry, so the garbage is made inside
        SyncsWhenCollected()  # unreachable from here on, found only by the cyclic collector
        kept = [[] for _ in range(10)]  # container allocations advance the collector's counter
        return x * 2 + len(kept)

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph = torch.cuda.CUDAGraph()
        out = capture(graph, body)
    finally:
        gc.set_threshold(*threshold)
    gc.collect()  # the finalizer runs here, outside the capture
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 12))


def test_runner_after_eager_training_steps_and_eval(weights):
    """Megatron runs eager iterations (default stream, .backward() into param.grad) and evaluation
    before graphs start; the runner must capture after that, and evaluation must work after it."""
    from megatron_ext.cuda_graphs.runner import GraphedMoELayer

    layer, twin = make_layer(weights), make_layer(weights)
    batches = [microbatch(60 + i) for i in range(6)]
    for x, g in batches[:3]:  # eager training steps on the default stream, grads accumulate
        for model in (layer, twin):
            out, _ = model(x.clone().requires_grad_(True))
            out.backward(g)
    with torch.no_grad():  # an evaluation pass
        for model in (layer, twin):
            model.eval()
            model(batches[3][0])
            model.train()
    layer._graph_runner = GraphedMoELayer(layer, num_slots=1)
    for step, (x, g) in enumerate(batches[3:]):
        got, want = run_pipelined(layer, [(x, g)]), run_pipelined(twin, [(x, g)])
        assert layer._graph_runner.eager_reason is None, layer._graph_runner.eager_reason
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[1][0], want[1][0]), f"step {step}"
        assert_close(got[2], want[2], rtol=1e-2, what=f"step {step} fc1 weight grad")
    with torch.no_grad():  # evaluation after capture: the replay slots do not hold the leases now
        layer.eval(), twin.eval()
        assert torch.equal(layer(batches[0][0])[0], twin(batches[0][0])[0])



def _param_grads(layer):
    return [p.grad.float().clone() for p in layer.parameters() if p.grad is not None]


def test_plain_autograd_accumulation_over_replays_equals_eager(weights):
    """Without Megatron's DDP, grads kept across steps (never cleared) sum as in eager: the
    replay's static buffers never become param.grad themselves."""
    eager, graphed = make_layer(weights), make_layer(weights, cuda_graphs=True)
    batches = [microbatch(80 + i) for i in range(3)]
    run_pipelined(graphed, batches[:1])  # captures
    for model in (eager, graphed):
        for p in model.parameters():
            p.grad = None
        for x, g in batches:
            out, _ = model(x.clone().requires_grad_(True))
            out.backward(g)
    static = {g.data_ptr() for g in graphed._graph_runner.slots[0].grads[1:] if g is not None}
    assert not any(p.grad.data_ptr() in static for p in graphed.parameters())
    for got, want in zip(_param_grads(graphed), _param_grads(eager)):
        assert_close(got, want, rtol=2e-2, what="accumulated param grad")


def test_replay_under_megatron_ddp_matches_eager_without_copying_grads(weights):
    """Under Megatron's DDP the replay's parameter gradients reach main_grad without a copy (the
    step allocates far less than the expert weights' size) and main_grad equals eager's."""
    eager_ddp, graphed_ddp = megatron_ddp(make_layer(weights)), megatron_ddp(make_layer(weights, cuda_graphs=True))
    expert_bytes = sum(p.numel() * p.element_size() for p in graphed_ddp.module.experts.parameters())
    batches = [microbatch(90 + i) for i in range(4)]
    for ddp in (eager_ddp, graphed_ddp):
        ddp.zero_grad_buffer()
        for step, (x, g) in enumerate(batches):
            x = x.clone().requires_grad_(True)
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
            out, _ = ddp(x)
            out.backward(g)
            torch.cuda.synchronize()
            if ddp is graphed_ddp and step > 0:  # step 0 captured
                fresh = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - allocated
                assert fresh < expert_bytes / 4, f"a replayed step allocated {fresh} bytes: gradients copied"
        ddp.finish_grad_sync()
    assert graphed_ddp.module._graph_runner.eager_reason is None, graphed_ddp.module._graph_runner.eager_reason
    for p_graph, p_eager in zip(graphed_ddp.module.parameters(), eager_ddp.module.parameters()):
        assert p_graph.grad is None
        assert_close(p_graph.main_grad, p_eager.main_grad, rtol=2e-2, what="main_grad")


def test_expert_wgrad_fusion_under_ddp_equals_ddp_add_eager_and_replayed(weights):
    """The experts' weight gradients added to main_grad in the GEMM (moe/expert_wgrad.py) against
    DDP's add of their bf16 gradients, over two iterations of 3 microbatches: eager and replayed
    (the runner sets DDP's flag after each replay: zero_grad_buffer clears it every iteration).
    main_grad agrees to the bf16 rounding the add path takes per microbatch; replayed equals eager."""
    layers = {"add": megatron_ddp(make_layer(weights, expert_wgrad_fusion=False)),
              "fused": megatron_ddp(make_layer(weights)),
              "fused graphed": megatron_ddp(make_layer(weights, cuda_graphs=True))}
    batches = [microbatch(120 + i) for i in range(3)]
    for iteration in range(2):
        grads = {}
        for name, ddp in layers.items():
            ddp.zero_grad_buffer()
            for x, g in batches:
                ddp(x.clone().requires_grad_(True))[0].backward(g)
            ddp.finish_grad_sync()
            experts = ddp.module.experts
            grads[name] = [experts.fc1_weight.main_grad.clone(), experts.fc2_weight.main_grad.clone()]
            assert experts.fc1_weight.grad_added_to_main_grad == (name != "add")
        assert layers["fused graphed"].module._graph_runner.eager_reason is None
        assert len(layers["fused graphed"].module._graph_runner.main_grad_params) == 2
        for name in ("fused", "fused graphed"):
            for got, want in zip(grads[name], grads["add"]):
                assert torch.isfinite(got).all(), f"iteration {iteration}, {name}: main_grad not finite"
                relative = ((got - want).norm() / want.norm()).item()
                print(f"iteration {iteration}, {name} against DDP's add: relative difference {relative:.2e}")
                assert relative < 1e-2, f"iteration {iteration}, {name}: relative difference {relative:.2e}"
        for got, want in zip(grads["fused graphed"], grads["fused"]):
            assert torch.equal(got, want), f"iteration {iteration}: replayed main_grad differs from eager"


def test_replayed_wgrad_fusion_follows_main_grad_when_ddp_reallocates_it(weights):
    """DDP's offload_grad_buffers / restore_grad_buffers reallocate main_grad: the runner captures
    again (the old graphs would write freed memory) and main_grad equals eager's after it."""
    eager, graphed = megatron_ddp(make_layer(weights)), megatron_ddp(make_layer(weights, cuda_graphs=True))
    batches = [microbatch(140 + i) for i in range(2)]
    held = []
    for iteration in range(2):
        grads = []
        for ddp in (eager, graphed):
            ddp.zero_grad_buffer()
            for x, g in batches:
                ddp(x.clone().requires_grad_(True))[0].backward(g)
            ddp.finish_grad_sync()
            grads.append([p.main_grad.clone() for p in ddp.module.experts.parameters()])
            if iteration == 0:
                held += reallocate_grad_buffers(ddp)
        runner = graphed.module._graph_runner
        assert runner.eager_reason is None and runner.slots is not None
        for got, want in zip(grads[1], grads[0]):
            assert torch.equal(got, want), f"iteration {iteration}: replayed main_grad differs from eager"
    del held


def reallocate_grad_buffers(ddp, tries: int = 8) -> list:
    """DDP's offload_grad_buffers + restore_grad_buffers until the experts' main_grad lives elsewhere;
    returns the blocks held to make it move (keep them alive). Holding blocks of the freed sizes
    does not always take the freed blocks: the caching allocator hands out the best-fitting cached
    block, which after other tests may be another one, and the restore then lands where it was."""
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    sizes = [(b.grad_data.numel(), b.grad_data.dtype) for b in buffers]
    before = ddp.module.experts.fc1_weight.main_grad.data_ptr()
    held = []
    for _ in range(tries):
        ddp.offload_grad_buffers()
        held += [torch.empty(n, dtype=dtype, device="cuda") for n, dtype in sizes]
        ddp.restore_grad_buffers()
        if ddp.module.experts.fc1_weight.main_grad.data_ptr() != before:
            return held
    raise AssertionError(f"main_grad did not move in {tries} offload/restore rounds")


def test_training_shape_stack_with_aux_loss_under_ddp_matches_eager():
    """check_training_shape_stack in a fresh process: the corruption it guards against depended on
    the allocator's state (it showed when this ran alone, not after the other tests here)."""
    stdout = _run_in_fresh_process()
    assert "training-shape stack: equal" in stdout, stdout[-4000:]


def test_training_shape_stack_with_nan_filled_graph_pools_matches_eager():
    """The same check with every graph's memory pool filled with NaN before its capture: a replay
    that read memory no kernel of it wrote would give a non-finite gradient. Fresh pools usually
    hold zeros, so this is what shows whether the per-graph pools cured the shared-pool corruption or
    only hid a read of unwritten memory (BENCHMARKS.md, "Graph runner regression")."""
    stdout = _run_in_fresh_process("--nan-filled-pools")
    assert "nan-filled graph pools: 4 pools" in stdout, stdout[-4000:]
    assert "training-shape stack: equal" in stdout, stdout[-4000:]


def _run_in_fresh_process(*flags: str) -> str:
    """This file's __main__ (check_training_shape_stack) in a new Python process; its stdout."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    child = subprocess.run([sys.executable, __file__, *flags], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"{child.stdout[-4000:]}\n{child.stderr[-4000:]}"
    return child.stdout


def nan_filled_graph_pools() -> list:
    """Make torch.cuda.graph_pool_handle hand out pools whose cached blocks hold NaN: 256 MiB of
    large blocks and 32 MiB of small ones (under 1 MiB each, the allocator's small pool). Returns the
    list the pools are kept alive in (a pool must outlive its graphs)."""
    pools = []
    if torch.cuda.graph.default_capture_stream is None:  # what torch.cuda.graph creates on first use
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    capture_stream = torch.cuda.graph.default_capture_stream

    def handle():
        pool = torch.cuda.MemPool()
        # On the capture stream: the allocator hands a capture only blocks freed on its own stream.
        with torch.cuda.stream(capture_stream), torch.cuda.use_mem_pool(pool):
            fillers = [torch.full((64 << 20,), float("nan"), device="cuda")]
            fillers += [torch.full((128 << 10,), float("nan"), device="cuda") for _ in range(64)]
        del fillers  # the blocks stay cached in the pool, NaN inside, for the capture to reuse
        capture_stream.synchronize()
        pools.append(pool)
        return pool.id

    torch.cuda.graph_pool_handle = handle
    return pools


def check_training_shape_stack():
    """The single-GPU functional case's MoE shape (hidden 1024, FFN 2048, 8 experts, top-2, 4096
    tokens as [1024, 4, H], load-balancing loss 1e-2 scaled by 1 / microbatches as Megatron's
    schedule sets it) in two stacked layers, each graphed, under Megatron's DDP with 8 accumulated
    microbatches: every main_grad finite and equal to eager's to bf16 rounding. Not bitwise: the
    replay hands back the layer's input gradient already summed over its paths (experts and
    router), eager autograd sums those and the residual's in another order, so the first layer's
    bf16 output gradient differs in the last bit (the last layer's grads are equal).
    Written after the functional case reported a NaN grad norm with --moe-ext-cuda-graphs. Two
    causes, each found with this check on an H200: the experts' backward released the activation
    between fc2's two gradient GEMMs, and (run alone) a forward graph and its backward sharing one
    memory pool (moe/expert_mlp.py, cuda_graphs/runner.py)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # Megatron's training sets a [1] tensor, as below
    shape = dict(hidden=1024, ffn=2048, experts=8, topk=2)
    stack_weights = [MoEWeights.random(8, 1024, 2048, seed=20 + i, dtype=torch.bfloat16) for i in range(2)]

    def stack(graphs):
        layers = []
        for number, w in enumerate(stack_weights, start=1):
            config = moe_config(**shape, dtype=torch.bfloat16, use_cpu_initialization=False,
                                moe_router_dtype="fp32", moe_router_load_balancing_type="aux_loss",
                                moe_aux_loss_coeff=1e-2, num_layers=2)
            layer = moe_builder(MoEExtConfig(transport="symm", cuda_graphs=graphs))(config=config).cuda()
            layer.set_layer_number(number)
            load_weights(layer, w)
            layers.append(megatron_ddp(layer))
        return layers

    def train(layers, batches):
        for ddp in layers:
            ddp.zero_grad_buffer()
        for x, g in batches:
            MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1 / len(batches), device="cuda"))
            h = x.clone().requires_grad_(True)
            out = h
            for ddp in layers:
                out = out + ddp(out)[0]
            out.backward(g)
        for ddp in layers:
            ddp.finish_grad_sync()
        return [p.main_grad.clone() for ddp in layers for p in ddp.module.parameters()]

    batches = []
    for i in range(8):
        gen = torch.Generator(device="cuda").manual_seed(300 + i)
        x = torch.randn(1024, 4, 1024, device="cuda", generator=gen).bfloat16()
        batches.append((x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16()))
    eager, graphed = stack(False), stack(True)
    last_layer_params = len(list(graphed[-1].module.parameters()))
    for step in range(2):  # a second step replays the captured graphs only
        want, got = train(eager, batches), train(graphed, batches)
        for ddp in graphed:
            assert ddp.module._graph_runner.eager_reason is None, ddp.module._graph_runner.eager_reason
        for index, (g, w) in enumerate(zip(got, want)):
            assert torch.isfinite(g).all(), f"step {step}: graphed main_grad {index} is not finite"
            relative = ((g - w).norm() / w.norm()).item()
            print(f"step {step} main_grad {index}: relative difference {relative:.2e}")
            assert relative < 1e-2, f"step {step}, main_grad {index}: relative difference {relative:.2e}"
            if index >= len(got) - last_layer_params:  # its output gradient is the same tensor in both
                assert torch.equal(g, w), f"step {step}: last layer's main_grad {index} differs from eager"
    print("training-shape stack: equal to eager")


if __name__ == "__main__":  # the fresh process of the two training-shape stack tests
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()
    nan_pools = nan_filled_graph_pools() if "--nan-filled-pools" in sys.argv else None
    check_training_shape_stack()
    if nan_pools is not None:
        print(f"nan-filled graph pools: {len(nan_pools)} pools")
