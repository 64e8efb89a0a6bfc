"""RowwiseMoELayer: Megatron's MoELayer with the rowwise dispatcher installed (via the spec).

Megatron-Core 0.19.2 picks its dispatcher from config.moe_token_dispatcher_type inside
MoELayer.__init__ with no spec slot, so this subclass lets the parent build everything
(router, experts, shared experts), then replaces `token_dispatcher`. The router (top-k,
softmax or sigmoid, aux losses) and shared experts are Megatron's own and keep working.
Options that would reintroduce host syncs or that the rowwise path does not implement are
rejected up front with the flag to change.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_ext.config import MoEExtConfig
from megatron_ext.host_affinity import host_core, pin_submitting_threads
from megatron_ext.moe import drop_notice
from megatron_ext.moe.dispatcher import RowwiseTokenDispatcher
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from megatron_ext.moe.fused_router import FusedTopKRouter
from megatron_ext.moe.metric_sinks import MetricSinks, in_megatron_graph_warmup, recomputing
from megatron_ext.moe.overflow import OverflowGuard
from megatron_ext.moe.route_map import unpack_metrics
from megatron_ext.quiet import warn_once
from megatron_ext.rules import (MXFP8_FP16, MXFP8_PROBS_ON_INPUT, ExpertSettings, changed_after_build, expert_problems,
                                graph_runner_clash, moe_problems, rowwise_problems)

logger = logging.getLogger(__name__)


def check_megatron_config(config, ext_config: MoEExtConfig | None = None) -> None:
    """Refuse TransformerConfig settings the rowwise layer cannot run with (megatron_ext.rules)."""
    settings = ExpertSettings.from_config(config)
    problems = rowwise_problems(config) + moe_problems(settings) + expert_problems(settings)
    problems += graph_runner_clash(config, ext_config or MoEExtConfig())
    if config.num_moe_experts is None:
        problems.append("num_moe_experts is None: the rowwise MoE layer needs a MoE config (--num-experts)")
    if problems:
        raise ValueError("the rowwise MoE dispatcher cannot run with:\n  - " + "\n  - ".join(problems))


class RowwiseMoELayer(MoELayer):
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer: bool = False, name: str | None = None, ext_config: MoEExtConfig | None = None):
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        ext_config = ext_config or MoEExtConfig()
        pg_collection = pg_collection or get_default_pg_collection()
        check_megatron_config(config, ext_config)
        if ext_config.mxfp8_dispatch:
            from megatron_ext.formats.mxfp8 import check_hidden

            check_hidden(config.hidden_size)
            if config.fp16 or config.params_dtype == torch.float16:
                raise ValueError(MXFP8_FP16)
        ep_size = pg_collection.ep.size()
        if config.num_moe_experts % ep_size:  # the group may differ from config.expert_model_parallel_size
            raise ValueError(f"num_moe_experts={config.num_moe_experts} is not divisible by the expert-parallel "
                             f"size {ep_size}; pick a divisible --expert-model-parallel-size")
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        if not isinstance(self.experts, DeviceOffsetGroupedMLP):
            raise TypeError(f"RowwiseMoELayer feeds capacity buffers with device offsets to its experts; "
                            f"{type(self.experts).__name__} cannot read them. Build the layer from "
                            f"megatron_ext.specs (experts=DeviceOffsetGroupedMLP).")
        if ext_config.mxfp8_dispatch and config.moe_apply_probs_on_input:
            raise ValueError(MXFP8_PROBS_ON_INPUT)
        if ext_config.dropless_arena and self.experts.arena_problems():
            raise ValueError("dropless_arena: the experts cannot keep their rows in the arena:\n  - "
                             + "\n  - ".join(self.experts.arena_problems()))
        self.ext_config = ext_config
        if isinstance(self.router, FusedTopKRouter):
            self.router.gemms_in_kernel = ext_config.router_gemms == "triton"
        self.token_dispatcher = RowwiseTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config, ext_config,
            pg_collection=pg_collection)
        drop_notice.give_for_layer(ext_config, self.token_dispatcher.ep_size)
        self._metrics = None  # running route-metric sums, int64 [2E + 5] (_metric_sinks)
        self._first_routes = None  # this rank's routes in the first training forward
        self._sinks: dict[bool, MetricSinks] = {}  # _metric_sinks, per self.training
        self._warm_up_sinks: dict[bool, MetricSinks] = {}  # scratch ones for Megatron's graph warm-up
        self._overflow = OverflowGuard() if ext_config.overflow_policy == "error" else None
        self._host_core = host_core() if ext_config.pin_host_threads else None
        self._graph_runner = None
        if ext_config.cuda_graphs:
            from megatron_ext.cuda_graphs.runner import GraphedMoELayer

            self._graph_runner = GraphedMoELayer(self, num_slots=ext_config.lease_slots)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        changed = changed_after_build(self.config)
        if changed:  # e.g. Megatron's decode padding: its router would pick more than top-k experts
            raise ValueError(changed)
        if self._graph_runner is not None and self.training and torch.is_grad_enabled():
            if intermediate_tensors is None and padding_mask is None:
                return self._graph_runner(hidden_states)
            warn_once(logger, "megatron_ext: training microbatches with a padding_mask or intermediate_tensors run "
                              "the MoE layer eagerly, not from its CUDA graphs (captured without them); in a pipeline "
                              "schedule with several live microbatches an eager one can hold the dispatch-buffer "
                              "slot a graph replay needs (an error names the slot)")
        return self.eager_forward(hidden_states, intermediate_tensors, padding_mask)

    def eager_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        counted = not recomputing()  # Megatron's full-layer recompute runs this forward again
        sinks = self._metric_sinks(hidden_states.device) if counted else None
        if sinks is not None and in_megatron_graph_warmup():  # not a training step (moe/metric_sinks.py)
            counted = False
            if self.training not in self._warm_up_sinks:
                self._warm_up_sinks[self.training] = sinks.scratch()
            sinks = self._warm_up_sinks[self.training]
        self.token_dispatcher.metric_sinks = sinks
        output = super().forward(hidden_states, intermediate_tensors, padding_mask)
        if self._host_core is not None:
            pin_submitting_threads(output[0], self._host_core)
        if self.training and counted:
            self._count_routes_beyond_first()
        return output

    def _metric_sinks(self, device: torch.device) -> MetricSinks | None:
        """Where this forward's route metrics go (the dispatcher's route adds them in place, so CUDA
        graphs keep updating the same tensors; no host read until `read_metrics` or `check_overflow`):
        while training, the running sums (RouteMetrics.packed's layout, in one int64 vector with one
        more entry at the end: _count_routes_beyond_first); under on_overflow='error' the overflow
        guard's counters, training and evaluation alike (no route dropped silently). Built once per
        mode: the tensors are reset in place."""
        sinks = self._sinks.get(self.training)
        if sinks is None and (self.training or self._overflow is not None):
            running = None
            if self.training:
                if self._metrics is None:
                    self._metrics = torch.zeros(2 * self.config.num_moe_experts + 5, dtype=torch.int64, device=device)
                    self._routes_beyond = self._metrics[-1:]
                running = self._metrics[:-1]
            guard = self._overflow
            if guard is not None:
                guard.ensure(self.config.num_moe_experts, self.token_dispatcher.ep_size, device)
            sinks = self._sinks[self.training] = MetricSinks(running, guard.sums if guard else None,
                                                             guard.peak_demand if guard else None)
        return sinks

    def _count_routes_beyond_first(self) -> None:
        """`read_metrics` counts this rank's routes as the first training forward's per forward; a
        microbatch below T_max has fewer, so the sums' last entry adds the difference. The add runs
        only for such a microbatch (none in static training, where every forward and graph replay
        has the first forward's shape)."""
        routes = self.token_dispatcher.routes_per_step
        if self._first_routes is None:
            self._first_routes = routes
        elif routes != self._first_routes:
            self._routes_beyond.add_(routes - self._first_routes)

    def check_overflow(self) -> None:
        """Bounded dropless: raise CapacityExceeded if routes overflowed since the last check (a host read)."""
        if self._overflow is not None and self.token_dispatcher.transport is not None:
            dispatcher = self.token_dispatcher
            where = "this MoE layer (built without a layer number)" if self.layer_number is None else \
                f"MoE layer {self.layer_number}"
            view, ext = None, self.ext_config
            if dispatcher.arena_layer is not None:
                arena_layer = dispatcher.arena_layer
                layout = arena_layer.layout
                where += (f" (dropless arena: {layout.layers} layers share {layout.rows} rows per microbatch, "
                          f"regions of {layout.region}; a layer before the last takes at most its region and the "
                          f"next one's, the last its region and the shared rest)")
                # A layer before the last runs on into the next region, or less where the shared area is smaller
                region_bound = not layout.is_last(arena_layer.index) and layout.region <= layout.shared
                widen = (f"--moe-ext-arena-region-factor (now {ext.arena_region_factor}; at most the capacity "
                         f"factor)" if region_bound else
                         f"--moe-ext-capacity-factor (now {ext.capacity_factor}; it sizes the shared area)")
                view = (arena_layer.capacity, widen)
            self._overflow.check(where, dispatcher.capacity, dispatcher.max_tokens * dispatcher.topk,
                                 ext.capacity_factor, arena_view=view)

    def read_metrics(self, reset: bool = True) -> dict | None:
        """Host copy of the routing metrics since the last read (synchronizes: logging steps only)."""
        if self._metrics is None:
            return None
        sums = self._metrics.to("cpu", copy=True)
        totals = unpack_metrics(sums[:-1])
        if reset:
            self._metrics.zero_()
        n = int(totals["steps"])
        if n == 0:
            return None
        dispatcher = self.token_dispatcher
        dropped = int(totals["dropped"])
        # A first training forward that failed after its route (counted) never set _first_routes
        first_routes = dispatcher.routes_per_step if self._first_routes is None else self._first_routes
        kept_routes = first_routes * n + int(sums[-1]) - dropped  # this rank's routes that moved
        return {"steps": n, "requested_per_expert": totals["requested"].tolist(),
                "kept_per_expert": totals["kept"].tolist(), "dropped_routes": dropped,
                "nonfinite_prob_routes": int(totals["nonfinite"]),
                "mean_buffer_fill": int(totals["received"]) / max(dispatcher.capacity, 1) / n,
                "capacity": dispatcher.capacity, "dispatch_row_bytes": dispatcher.row_bytes,
                "dispatch_buffer_bytes": dispatcher.capacity * dispatcher.row_bytes,
                "dispatched_bytes_per_step": kept_routes * dispatcher.row_bytes // n}
