"""Graph runner for the synchronization-free MoE layer: forward and backward per live slot.

Cost removed: host submission of the whole layer (router, route map, dispatch, experts,
combine, and their backward) becomes two graph launches per microbatch. Costs accepted: one
set of static buffers and saved activations per slot (slots = microbatches alive in the layer
at once, from the pipeline schedule), copies of the input and output gradient into the slot's
static tensors, and a capture at the first use of each slot.

Slots and leases agree by construction: slot i's forward is captured while slots 0..i-1 still
hold their dispatch-buffer leases, so each slot bakes in its own lease; the layer's
`lease_slots` must therefore be >= the number of graph slots. All slots capture into one
memory pool, forwards first (in slot order) then backwards, as a pipeline warm-up would.
If capture is impossible the runner logs why and the layer stays eager.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def capture_blockers(layer, hidden: torch.Tensor) -> list[str]:
    """Reasons this layer cannot be captured here (empty: capturable)."""
    reasons = []
    if not hidden.is_cuda:
        reasons.append(f"the input is on {hidden.device}, CUDA graphs need a GPU")
    ext = getattr(layer, "ext_config", None)
    if ext is None or ext.dispatcher != "rowwise":
        reasons.append("only the rowwise MoE layer is synchronization-free; Megatron's dispatchers wait on the host")
    elif ext.debug_checks:
        reasons.append("debug_checks reads device values on the host (a sync) inside the layer")
    return reasons


class _Slot:
    def __init__(self, static_input: torch.Tensor):
        self.input = static_input
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = torch.cuda.CUDAGraph()
        self.output = None
        self.grad_output = None
        self.grads = None
        self.busy = False


class _ReplaySlot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, runner, slot, *params):
        ctx.runner, ctx.slot = runner, slot
        slot.input.copy_(hidden)
        slot.forward_graph.replay()
        return slot.output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        slot = ctx.slot
        slot.grad_output.copy_(grad_output)
        slot.backward_graph.replay()
        ctx.runner._release(slot)
        grad_input, *param_grads = slot.grads
        return (grad_input, None, None, *param_grads)


class GraphedMoELayer:
    """Replays a MoE layer's forward+backward from per-slot CUDA graphs.

    `layer.eager_forward(hidden)` (or `layer(hidden)`) must return (output, bias) like
    Megatron's MoELayer. Call the runner instead: `out, bias = runner(hidden)`. The first call
    captures every slot; afterwards the runner owns the captured dispatch-buffer leases, so an
    eager call of the same layer cannot overwrite a slot's payload (it takes a spare lease or
    fails clearly).
    """

    def __init__(self, layer, num_slots: int, warmup_iters: int = 2):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        lease_slots = getattr(getattr(layer, "ext_config", None), "lease_slots", num_slots)
        if lease_slots < num_slots:
            raise ValueError(f"{num_slots} graph slots need as many dispatch-buffer leases, but the layer has "
                             f"lease_slots={lease_slots}; set --moe-ext-lease-slots >= {num_slots}")
        self.layer = layer
        self.num_slots = num_slots
        self.warmup_iters = warmup_iters
        self.slots: list[_Slot] | None = None
        self.eager_reason: str | None = None
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.forward_fn = getattr(layer, "eager_forward", layer)
        self.owned_leases = []

    def __call__(self, hidden: torch.Tensor):
        if self.eager_reason is not None:
            return self.forward_fn(hidden)
        if self.slots is None:
            reasons = capture_blockers(self.layer, hidden)
            if reasons:
                return self._fall_back("; ".join(reasons), hidden)
            try:
                self._capture(hidden)
            except Exception as error:  # noqa: BLE001 - any capture failure: run eagerly, say why
                return self._fall_back(f"capture failed: {type(error).__name__}: {error}", hidden)
        slot = self._acquire(hidden)
        return _ReplaySlot.apply(hidden, self, slot, *self.params), None

    def _fall_back(self, reason: str, hidden: torch.Tensor):
        self.eager_reason = reason
        logger.warning("megatron_ext: MoE layer runs eagerly, not from CUDA graphs: %s", reason)
        return self.forward_fn(hidden)

    def _acquire(self, hidden: torch.Tensor) -> _Slot:
        if hidden.shape != self.slots[0].input.shape or hidden.dtype != self.slots[0].input.dtype:
            raise ValueError(f"graphed MoE layer was captured for input {tuple(self.slots[0].input.shape)} "
                             f"{self.slots[0].input.dtype}, got {tuple(hidden.shape)} {hidden.dtype}; "
                             f"microbatch shapes must stay static")
        for slot in self.slots:
            if not slot.busy:
                slot.busy = True
                return slot
        raise RuntimeError(f"all {self.num_slots} CUDA-graph slot(s) of this MoE layer hold live microbatches; "
                           f"size the slots from the pipeline schedule (megatron_ext.cuda_graphs.live_microbatches)")

    def _release(self, slot: _Slot) -> None:
        slot.busy = False

    def _capture(self, sample: torch.Tensor) -> None:
        self._warm_up(sample)
        pool = torch.cuda.graph_pool_handle()
        slots = [_Slot(sample.detach().clone().requires_grad_(True)) for _ in range(self.num_slots)]
        for slot in slots:  # forwards first: each keeps its lease, as in a pipeline warm-up
            with torch.cuda.graph(slot.forward_graph, pool=pool):
                slot.output, _ = self.forward_fn(slot.input)
            slot.grad_output = torch.empty_like(slot.output)
        for slot in reversed(slots):
            with torch.cuda.graph(slot.backward_graph, pool=pool):
                slot.grads = torch.autograd.grad(slot.output, (slot.input, *self.params), slot.grad_output,
                                                 allow_unused=True)
        self.slots = slots
        pool = getattr(getattr(getattr(self.layer, "token_dispatcher", None), "transport", None), "pool", None)
        if pool is not None:  # captures took leases 0..n-1 in order and gave them back; keep them now
            self.owned_leases = [pool.acquire() for _ in range(self.num_slots)]

    def _warm_up(self, sample: torch.Tensor) -> None:
        """Eager steps on a side stream: allocations, compilation and lazy buffers happen here."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                x = sample.detach().clone().requires_grad_(True)
                out, _ = self.forward_fn(x)
                torch.autograd.grad(out, (x, *self.params), torch.ones_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(stream)
