"""Host time of named functions inside a step, measured where they run (`bench_moe_layer --host-census`).

An op's host cost inside a long step is several times its cost in a tight loop: the host's
caches are cold for each op (BENCHMARKS.md, "Host time: what an op costs inside the step":
the router's GEMM took 21-27 us in a loop, 115 us after a layer step). So host changes are
chosen from in-step figures. The census wraps each named function with a perf_counter pair
while steps run (forward and backward, on whichever thread autograd uses), then puts the
originals back. Times are inclusive (a function's callees count in it too); the wrappers add
about 1 us per call. The device is synchronized between steps, outside the timed region.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from collections.abc import Callable

from megatron_ext.bench.measurement import synchronize

# What the rowwise layer step runs, as (module, attribute path); Functions' forward and backward
# are static methods. Names that a module lacks are skipped (other paths, other versions).
ROWWISE_TARGETS = (
    ("megatron_ext.moe.layer", "RowwiseMoELayer.eager_forward"),
    ("megatron.core.transformer.moe.moe_layer", "MoELayer.forward"),
    ("megatron_ext.moe.fused_router", "FusedTopKRouter.forward"),
    ("megatron_ext.moe.dispatcher", "RowwiseTokenDispatcher.dispatch_preprocess"),
    ("megatron_ext.moe.dispatcher", "RowwiseTokenDispatcher.token_dispatch"),
    ("megatron_ext.moe.dispatcher", "RowwiseTokenDispatcher.dispatch_postprocess"),
    ("megatron_ext.moe.dispatcher", "RowwiseTokenDispatcher.token_combine"),
    ("megatron_ext.moe.experts", "DeviceOffsetGroupedMLP.forward"),
    ("megatron_ext.moe.fused_router", "_Routing.forward"),
    ("megatron_ext.moe.fused_router", "_Routing.backward"),
    ("megatron_ext.moe.fused_router", "_gate"),
    ("megatron_ext.moe.fused_router", "_split_gating_grads"),
    ("megatron_ext.kernels.router_topk", "gate_router_topk"),
    ("megatron_ext.kernels.router_topk", "gate_router_topk_backward"),
    ("megatron_ext.kernels.router_topk", "gate_weight_grad"),  # the name router_topk calls
    ("megatron_ext.moe.fused_routes", "route"),
    ("megatron_ext.kernels.route_plan", "plan_and_place"),
    ("megatron_ext.moe.row_autograd", "_DispatchRows.forward"),
    ("megatron_ext.moe.row_autograd", "_DispatchRows.backward"),
    ("megatron_ext.moe.row_autograd", "_CombineRows.forward"),
    ("megatron_ext.moe.row_autograd", "_CombineRows.backward"),
    ("megatron_ext.moe.expert_mlp", "_SwiGLUGroupedMLP.forward"),
    ("megatron_ext.moe.expert_mlp", "_SwiGLUGroupedMLP.backward"),
    ("megatron_ext.moe.experts", "counts_to_offsets"),
    ("megatron_ext.moe.transport.symm", "put_rows"),
    ("megatron_ext.moe.transport.symm", "get_rows"),
    ("megatron_ext.moe.layer", "RowwiseMoELayer._count_routes_beyond_first"),
    ("megatron.core.transformer.moe.router", "TopKRouter.attach_and_log_load_balancing_loss"),
    ("torch", "mm"),
    ("torch", "_grouped_mm"),
    ("torch", "empty"),
    ("torch", "zeros"),
    ("torch", "Tensor.fill_"),
    ("torch", "Tensor.add_"),
    ("torch", "Tensor.new_zeros"),
    ("triton.runtime.jit", "JITFunction.run"),
)


def _resolve(module_name: str, path: str):
    """(owner, attribute name, the function to call) or None where the name is missing."""
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
        if owner is None:
            return None
    if not hasattr(owner, name):
        return None
    return owner, name, getattr(owner, name)


def _install(owner, name: str, wrapper):
    """Put `wrapper` in place of owner.name; returns what puts the original back."""
    own = vars(owner)
    had, raw = name in own, own.get(name)
    is_static = isinstance(owner, type) and isinstance(raw, staticmethod)
    setattr(owner, name, staticmethod(wrapper) if is_static else wrapper)

    def restore():
        if had:
            setattr(owner, name, raw)
        else:  # inherited: drop the override
            delattr(owner, name)
    return restore


def function_census(step: Callable[[], object], targets=ROWWISE_TARGETS, iters: int = 20,
                    warmup: int = 3) -> list[dict]:
    """Per named function: mean host us per step and calls per step over `iters` steps, costliest first."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    counting = False

    def timed(label, fn):
        def call(*args, **kwargs):
            if not counting:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
                calls[label] += 1
        return call

    restores = []
    try:
        for module_name, path in targets:
            found = _resolve(module_name, path)
            if found is not None:
                owner, name, function = found
                restores.append(_install(owner, name, timed(f"{module_name}.{path}", function)))
        for _ in range(warmup):
            step()
        for _ in range(iters):
            synchronize()
            counting = True
            step()
            counting = False
        synchronize()
    finally:
        for restore in reversed(restores):
            restore()
    rows = [{"function": label, "us_per_step": seconds / iters * 1e6, "calls_per_step": calls[label] / iters}
            for label, seconds in totals.items()]
    return sorted(rows, key=lambda row: -row["us_per_step"])
