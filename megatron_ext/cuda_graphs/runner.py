"""Graph runner for the synchronization-free MoE layer: forward and backward per live slot.

Cost removed: host submission of the whole layer (router, route map, dispatch, experts,
combine, and their backward) becomes two graph launches per microbatch. Costs accepted: one
set of static buffers and saved activations per slot (slots = microbatches alive in the layer
at once, from the pipeline schedule), copies of the input and output gradient into the slot's
static tensors, a capture at the first training forward, and at EP > 1 one all-reduce after
it so that every rank replays or every rank runs eagerly. Parameter gradients reach Megatron's
DDP without a copy (see hand_over).

Slots and leases agree by construction: graph slot i's forward is captured while slots
0..i-1 still hold their dispatch-buffer leases, so it bakes in pool slot i; the layer's
`lease_slots` must therefore be >= the number of graph slots. A replay holds pool slot i from
its forward to its backward, so eager forwards between steps (evaluation) find the slots free.
Forwards are captured first (in slot order), then backwards. Each graph has its own memory pool:
a pipeline schedule replays one slot's backward while other slots are live (1F1B: B0 after F1),
so memory a shared pool would hand from one slot's freed activations to another slot's backward
temporaries could still be in use; and a forward and its own backward sharing one pool gave
corrupted expert weight gradients at the functional case's shape (NaN in fc2's, deterministic
for a given allocator state, not a timing race: host syncs around the replays did not change it;
tests/gpu/test_graph_runner_gpu.py, the training-shape stack run on its own). Cost accepted: no
graph's temporaries are shared with another's (one set per graph per live microbatch).

If capture is impossible or fails (on any rank of the EP group) the runner logs why and the
layer stays eager; a failed capture leaves the process usable (cuda_graphs/capture.py). An error
in the eager warm-up steps before it is raised at EP > 1: the peers are then inside the warm-up's
device barriers, waiting for this rank, and only their peer timeout ends the wait.
The captured layer issues no NCCL work (the symm transport exchanges route counts over
symmetric memory), so graphs never keep destroy_process_group from returning; `reset`
drops them early where a caller wants their memory back.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_ext.cuda_graphs import arena_slots
from megatron_ext.cuda_graphs.blockers import capture_blockers, transport_blocker
from megatron_ext.cuda_graphs.capture import CaptureFailed, capture
from megatron_ext.cuda_graphs.uncounted_steps import metrics_untouched
from megatron_ext.moe.peer_failure import named_phase, peer_timeout_seconds
from megatron_ext.cuda_graphs.main_grads import (flag_added, flagged_by, main_grad_addresses, main_grads_moved,
                                                 main_grads_set_aside)

logger = logging.getLogger(__name__)


class WarmUpFailed(RuntimeError):
    """The eager warm-up failed on this rank at EP > 1: its peers cannot be told (module docstring)."""


def ep_group_of(layer):
    dispatcher = getattr(layer, "token_dispatcher", None)
    group = getattr(dispatcher, "ep_group", None)
    return group if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1 else None


class _Slot:
    def __init__(self, index: int, static_input: torch.Tensor):
        self.index = index
        self.input = static_input
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = torch.cuda.CUDAGraph()
        self.output = None
        self.grad_output = None
        self.grads = None
        self.busy = False
        self.lease = None  # the dispatch-buffer lease this slot's graphs write, while live


class _ReplaySlot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, runner, slot, *params):
        ctx.runner, ctx.slot = runner, slot
        runner._unalias_param_grads()
        slot.input.copy_(hidden)
        slot.forward_graph.replay()
        runner._watch("graphed MoE layer forward")
        return slot.output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        slot, runner = ctx.slot, ctx.runner
        runner._unalias_param_grads()
        slot.grad_output.copy_(grad_output)
        slot.backward_graph.replay()
        flag_added(runner.main_grad_params)
        runner._watch("graphed MoE layer backward")
        runner._release(slot)
        grad_input, *param_grads = slot.grads
        return (grad_input, None, None, *(hand_over(p, g) for p, g in zip(runner.params, param_grads)))


def hand_over(param, static_grad):
    """What autograd gets for `param` from a replay: the slot's static gradient buffer.

    Under Megatron's DDP (and FSDP) a parameter carries `grad_added_to_main_grad` and their hook
    consumes param.grad right after accumulation (adds it to main_grad, drops it). There the
    buffer goes as a detached alias, which AccumulateGrad takes without a copy: the copy it makes
    of a tensor someone else holds cost ~0.4 ms per step at the reference shape (the expert
    weights' gradients), enough to make graphs slower than eager. Elsewhere autograd keeps
    copying: an alias kept past the next replay of the slot's graphs would be overwritten.
    `_unalias_param_grads` guards the first case too.
    """
    if static_grad is None:
        return None
    return static_grad.detach() if hasattr(param, "grad_added_to_main_grad") else static_grad


class GraphedMoELayer:
    """Replays a MoE layer's forward+backward from per-slot CUDA graphs.

    `layer.eager_forward(hidden)` (or `layer(hidden)`) must return (output, bias) like
    Megatron's MoELayer. Call the runner instead: `out, bias = runner(hidden)`. The first call
    captures every slot (the layer may have run eager steps before, on any stream).
    `out` is the slot's static output buffer, valid until that slot's next replay (the microbatch
    after this one's backward, when slots = live microbatches): use it before then, as
    Megatron's transformer layer does by adding it to the residual at once.
    """

    def __init__(self, layer, num_slots: int, warmup_iters: int = 2):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if warmup_iters < 1:  # the eager steps create what capture cannot allocate (Megatron's aux-loss scale)
            raise ValueError(f"warmup_iters must be >= 1, got {warmup_iters}")
        lease_slots = getattr(getattr(layer, "ext_config", None), "lease_slots", num_slots)
        if lease_slots < num_slots:
            raise ValueError(f"{num_slots} graph slots need as many dispatch-buffer leases, but the layer has "
                             f"lease_slots={lease_slots}; set --moe-ext-lease-slots >= {num_slots}")
        self.layer = layer
        self.num_slots = num_slots
        self.warmup_iters = warmup_iters
        self.slots: list[_Slot] | None = None
        self.eager_reason: str | None = None
        self._all_params = list(layer.parameters())
        self.params: list = []  # the trainable ones at capture: the captured backward differentiates these
        self._captured_grad_flags: tuple[bool, ...] = ()
        self._static_grad_storage: set[int] = set()  # the slots' static parameter-gradient buffers
        self.main_grad_params: list = []  # whose gradients the captured backward adds to main_grad itself
        self._main_grad_addresses: list[int] = []  # where those main_grads were at capture
        self.forward_fn = getattr(layer, "eager_forward", layer)

    def __call__(self, hidden: torch.Tensor):
        if self.eager_reason is not None:
            return self.forward_fn(hidden)
        grad_flags = tuple(p.requires_grad for p in self._all_params)
        if not hidden.requires_grad and not any(grad_flags):
            # Nothing to differentiate (a frozen layer under frozen layers): a replay's backward would
            # never run to free its slot; the eager dispatcher keeps its own backward (moe/dispatcher.py)
            return self.forward_fn(hidden)
        if self.slots is not None and main_grads_moved(self.main_grad_params, self._main_grad_addresses):
            self._drop_for_moved_main_grads()
        if self.slots is not None and grad_flags != self._captured_grad_flags:
            self._drop_for_changed_trainable_params()
        if self.slots is None:
            reasons = capture_blockers(self.layer, hidden)
            if reasons:
                return self._fall_back("; ".join(reasons), hidden)
            reason = self._capture_agreed(hidden)
            if reason is not None:
                return self._fall_back(reason, hidden)
        slot = self._acquire(hidden)
        return _ReplaySlot.apply(hidden, self, slot, *self.params), None

    def _drop_for_moved_main_grads(self) -> None:
        """DDP's gradient buffers were re-created since capture: the graphs would write freed memory."""
        self._drop_graphs("the main_grad of parameters whose weight gradients the MoE layer's CUDA graphs add to "
                          "main_grad moved since capture (DDP's gradient buffers were re-created, e.g. by "
                          "offload_grad_buffers / restore_grad_buffers)", "re-create the buffers", "re-creating them")

    def _drop_for_changed_trainable_params(self) -> None:
        """A parameter of the layer was frozen or unfrozen since capture (e.g. --freeze-all-layers after
        the model was built, staged unfreezing): the captured backward differentiates the old set, so
        a newly trainable parameter would get no gradient."""
        self._drop_graphs("parameters of the MoE layer were frozen or unfrozen since its CUDA graphs were captured "
                          "(the captured backward gives gradients to the parameters trainable at capture)",
                          "change requires_grad", "changing them")

    def _drop_graphs(self, problem: str, change: str, after_changing: str) -> None:
        """The graphs no longer fit the layer (`problem`). With one rank, capture again. At EP > 1 a rank
        cannot tell whether its peers saw the same change (they capture together, or a rank warming up
        would wait on peers replaying), so the caller drops every rank's graphs at the same point."""
        if any(slot.busy for slot in self.slots):
            raise RuntimeError(f"{problem} while microbatches are live in the graphs; {change} between iterations")
        if ep_group_of(self.layer) is not None:
            raise RuntimeError(f"{problem}; at EP > 1 call megatron_ext.cuda_graphs.release_cuda_graphs(model) on "
                               f"every rank after {after_changing}, so that all ranks capture again together")
        logger.info("megatron_ext: %s; capturing again", problem)
        self.reset()

    def _fall_back(self, reason: str, hidden: torch.Tensor):
        self.eager_reason = reason
        logger.warning("megatron_ext: MoE layer runs eagerly, not from CUDA graphs: %s", reason)
        return self.forward_fn(hidden)

    def _capture_agreed(self, hidden: torch.Tensor) -> str | None:
        """Warm up and capture; at EP > 1 every rank learns whether all captured (init time: a sync).
        Any error in the capture (which waits on no peer: captured kernels do not run) becomes this
        rank's reason, so its peers are told too instead of waiting in the all-reduce. So does an
        error in the warm-up with one rank; at EP > 1 the warm-up's eager steps pass device
        barriers that the peers are already waiting in, so it is raised (WarmUpFailed)."""
        pool = self._lease_pool()
        self._take_trainable_params()
        try:
            if pool is not None and pool.live:
                raise CaptureFailed(f"{pool.live} dispatch-buffer slot(s) hold live microbatches at capture time; "
                                    f"capture needs the layer idle")
            with arena_slots.arena_untouched(arena_slots.arena_of(self.layer)):
                self._warm_up_or_raise(hidden)
                reason = transport_blocker(self.layer)
                if reason is None:
                    self._capture(hidden)
        except CaptureFailed as error:
            reason = f"capture failed: {error}"
        except WarmUpFailed:
            raise
        except Exception as error:  # noqa: BLE001 (e.g. out of memory): reported and agreed on, not raised
            reason = f"warm-up or capture failed: {type(error).__name__}: {error}"
            if pool is not None:
                pool.release_all()  # a warm-up forward whose backward never ran (the layer was idle before)
        group = ep_group_of(self.layer)
        if group is not None:
            captured = torch.tensor([0 if reason else 1], dtype=torch.int32, device=hidden.device)
            with named_phase("CUDA-graph capture agreement", group, peer_timeout_seconds(None)):
                dist.all_reduce(captured, op=dist.ReduceOp.MIN, group=group)
                agreed = bool(captured.item())
            if reason is None and not agreed:
                reason = "capture failed on another rank of the expert-parallel group (all ranks run eagerly)"
        if reason is not None:
            self.reset()
        return reason

    def _take_trainable_params(self) -> None:
        """The parameters the warm-up and the captured backward differentiate: the trainable ones now."""
        self.params = [p for p in self._all_params if p.requires_grad]
        self._captured_grad_flags = tuple(p.requires_grad for p in self._all_params)

    def _warm_up_or_raise(self, hidden: torch.Tensor) -> None:
        try:
            self._warm_up(hidden)
        except Exception as error:
            if ep_group_of(self.layer) is None:
                raise
            pool = self._lease_pool()
            if pool is not None:
                pool.release_all()
            raise WarmUpFailed(
                f"the CUDA-graph warm-up of this MoE layer failed on this rank ({type(error).__name__}: {error}); its "
                f"expert-parallel peers wait in the warm-up's device barriers for this rank and stop at their peer "
                f"timeout (--moe-ext-peer-timeout-s). Fix the cause, or turn off --moe-ext-cuda-graphs") from error

    def _acquire(self, hidden: torch.Tensor) -> _Slot:
        if hidden.shape != self.slots[0].input.shape or hidden.dtype != self.slots[0].input.dtype:
            raise ValueError(f"graphed MoE layer was captured for input {tuple(self.slots[0].input.shape)} "
                             f"{self.slots[0].input.dtype}, got {tuple(hidden.shape)} {hidden.dtype}; microbatch "
                             f"shapes must stay static (fixed --seq-length and --micro-batch-size, no variable-length "
                             f"batches), or turn off --moe-ext-cuda-graphs")
        pool = self._lease_pool()
        for index, slot in enumerate(self.slots):
            if not slot.busy:
                # Lease and arena slot first, the slot marked busy last: a refusal leaves nothing taken.
                lease = None if pool is None else pool.acquire(slot=index)  # the buffer this graph writes
                try:
                    arena_slots.acquire(arena_slots.arena_of(self.layer), index)
                except BaseException:
                    if lease is not None:
                        lease.release()
                    raise
                slot.lease, slot.busy = lease, True
                return slot
        raise RuntimeError(f"all {self.num_slots} CUDA-graph slot(s) of this MoE layer hold live microbatches (a "
                           f"forward ran again before the previous backward); raise --moe-ext-lease-slots "
                           f"(MoEExtConfig.lease_slots, the number of graph slots) to the live microbatches of the "
                           f"pipeline schedule (megatron_ext.cuda_graphs.live_microbatches)")

    def _release(self, slot: _Slot) -> None:
        slot.busy = False
        arena_slots.release(arena_slots.arena_of(self.layer), slot.index)
        if slot.lease is not None:
            slot.lease.release()
            slot.lease = None

    def _watch(self, phase: str) -> None:
        """Let the transport's barrier watchdog bound the replayed barriers too (one event per graph)."""
        watchdog = getattr(getattr(getattr(self.layer, "token_dispatcher", None), "transport", None), "watchdog", None)
        if watchdog is not None:
            watchdog.record(phase)

    def _unalias_param_grads(self) -> None:
        """Before any replay: a param.grad that is still an alias of a static gradient buffer (a
        hook that did not consume it, see hand_over) gets its own copy, as it would have had."""
        for param in self.params:
            if param.grad is not None and param.grad.untyped_storage().data_ptr() in self._static_grad_storage:
                param.grad = param.grad.clone()

    def _lease_pool(self):
        return getattr(getattr(getattr(self.layer, "token_dispatcher", None), "transport", None), "pool", None)

    def _capture(self, sample: torch.Tensor) -> None:
        leases = self._lease_pool()
        slots = [_Slot(index, sample.detach().clone().requires_grad_(True)) for index in range(self.num_slots)]
        arena = arena_slots.arena_of(self.layer)
        try:  # one memory pool per graph (module docstring)
            for slot in slots:  # forwards first: each keeps its lease, as in a pipeline warm-up
                with arena_slots.capturing_slot(arena, slot.index):
                    slot.output, _ = capture(slot.forward_graph, lambda s=slot: self.forward_fn(s.input),
                                             torch.cuda.graph_pool_handle())
                slot.grad_output = torch.empty_like(slot.output)
            for slot in reversed(slots):
                slot.grads, main_grad_params = flagged_by(self.params, lambda s=slot: capture(
                    s.backward_graph, lambda: torch.autograd.grad(
                        s.output, (s.input, *self.params), s.grad_output, allow_unused=True),
                    torch.cuda.graph_pool_handle()))
        except BaseException:  # leave nothing half-captured, whatever stopped the capture
            for slot in slots:
                slot.forward_graph.reset()
                slot.backward_graph.reset()
            if leases is not None:
                leases.release_all()  # host-side leases of forwards whose backward was never captured
            raise
        self.slots = slots
        self.main_grad_params = main_grad_params
        self._main_grad_addresses = main_grad_addresses(main_grad_params)
        self._static_grad_storage = {grad.untyped_storage().data_ptr()
                                     for slot in slots for grad in slot.grads[1:] if grad is not None}

    def _warm_up(self, sample: torch.Tensor) -> None:
        """Eager steps on a side stream: allocations, compilation and lazy buffers happen here.
        They are not training steps, so what they add to the logged metrics is taken back, and what
        they add to DDP's main_grad goes to a stand-in (cuda_graphs/main_grads.py)."""
        with metrics_untouched(self.layer), main_grads_set_aside(self.params):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup_iters):
                    x = sample.detach().clone().requires_grad_(True)
                    out, _ = self.forward_fn(x)
                    torch.autograd.grad(out, (x, *self.params), torch.ones_like(out), allow_unused=True)
            torch.cuda.current_stream().wait_stream(stream)

    def reset(self) -> None:
        """Drop the graphs (and their memory pools); the next training forward captures again."""
        if self.slots is not None:
            if any(slot.busy for slot in self.slots):
                raise RuntimeError("cannot drop the MoE layer's CUDA graphs while a microbatch is live in them: run "
                                   "the backward of every forward first (drop the graphs between iterations)")
            for slot in self.slots:
                slot.forward_graph.reset()
                slot.backward_graph.reset()
        self.slots = None
        self._static_grad_storage = set()
        self.main_grad_params, self._main_grad_addresses = [], []


def release_cuda_graphs(model) -> int:
    """Drop every rowwise MoE layer's CUDA graphs in `model`, a module or Megatron's list of model
    chunks (e.g. before tearing down, or after DDP re-created its gradient buffers); returns how many."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    released = 0
    for module in (m for chunk in chunks for m in chunk.modules()):
        runner = getattr(module, "_graph_runner", None)
        if isinstance(runner, GraphedMoELayer) and runner.slots is not None:
            runner.reset()
            released += 1
    return released
