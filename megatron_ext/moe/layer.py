"""RowwiseMoELayer: Megatron's MoELayer with the rowwise dispatcher installed (via the spec).

Megatron-Core 0.19.2 picks its dispatcher from config.moe_token_dispatcher_type inside
MoELayer.__init__ with no spec slot, so this subclass lets the parent build everything
(router, experts, shared experts), then replaces `token_dispatcher`. The router (top-k,
softmax or sigmoid, aux losses) and shared experts are Megatron's own and keep working.
Options that would reintroduce host syncs or that the rowwise path does not implement are
rejected up front with the flag to change.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.dispatcher import RowwiseTokenDispatcher
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP

# (TransformerConfig field, value that is fine, why it is refused, what to do)
_INCOMPATIBLE = [
    ("moe_expert_capacity_factor", None, "Megatron's per-expert capacity drops tokens on the host path",
     "use --moe-ext-capacity-factor (per-destination-rank capacity) instead"),
    ("moe_pad_expert_input_to_capacity", False, "pads on Megatron's dispatcher path",
     "drop --moe-pad-expert-input-to-capacity"),
    ("moe_shared_expert_overlap", False, "overlaps shared experts inside Megatron's dispatcher",
     "drop --moe-shared-expert-overlap"),
    ("overlap_moe_expert_parallel_comm", False, "is built for Megatron's alltoall/flex dispatchers",
     "drop --overlap-moe-expert-parallel-comm"),
    ("moe_latent_size", None, "needs Transformer Engine latent projections", "drop --moe-latent-size"),
]


def check_megatron_config(config) -> None:
    for field, fine, why, fix in _INCOMPATIBLE:
        value = getattr(config, field, fine)
        if value not in (fine, None, False, 0):
            raise ValueError(f"the rowwise MoE dispatcher cannot run with {field}={value!r}: it {why}; {fix}")
    etp = config.expert_tensor_parallel_size or 1
    if etp != 1:
        raise ValueError(f"the rowwise MoE dispatcher needs expert_tensor_parallel_size=1, got {etp}; "
                         f"use --expert-tensor-parallel-size 1 (fold experts over EP instead)")
    if config.num_moe_experts is None or config.moe_router_topk > config.num_moe_experts:
        raise ValueError(f"moe_router_topk={config.moe_router_topk} exceeds num_moe_experts="
                         f"{config.num_moe_experts}; choose top-k <= number of experts")


class RowwiseMoELayer(MoELayer):
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer: bool = False, name: str | None = None, ext_config: MoEExtConfig | None = None):
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        ext_config = ext_config or MoEExtConfig()
        pg_collection = pg_collection or get_default_pg_collection()
        check_megatron_config(config)
        if ext_config.mxfp8_dispatch:
            from megatron_ext.moe.mxfp8 import check_hidden

            check_hidden(config.hidden_size)
        ep_size = pg_collection.ep.size()
        if config.num_moe_experts % ep_size:
            raise ValueError(f"num_moe_experts={config.num_moe_experts} is not divisible by the expert-parallel "
                             f"size {ep_size}; pick a divisible --expert-model-parallel-size")
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        if not isinstance(self.experts, DeviceOffsetGroupedMLP):
            raise TypeError(f"RowwiseMoELayer feeds capacity buffers with device offsets to its experts; "
                            f"{type(self.experts).__name__} cannot read them. Build the layer from "
                            f"megatron_ext.specs (experts=DeviceOffsetGroupedMLP).")
        self.ext_config = ext_config
        self.token_dispatcher = RowwiseTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config, ext_config,
            pg_collection=pg_collection)
        self._metrics = None
        self._graph_runner = None
        if ext_config.cuda_graphs:
            from megatron_ext.cuda_graphs.runner import GraphedMoELayer

            self._graph_runner = GraphedMoELayer(self, num_slots=ext_config.lease_slots)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if self._graph_runner is not None and intermediate_tensors is None and padding_mask is None \
                and self.training and torch.is_grad_enabled():
            return self._graph_runner(hidden_states)
        return self.eager_forward(hidden_states, intermediate_tensors, padding_mask)

    def eager_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        output = super().forward(hidden_states, intermediate_tensors, padding_mask)
        if self.training:
            self._accumulate_metrics(self.token_dispatcher.route_map.metrics)
        return output

    @torch.no_grad()
    def _accumulate_metrics(self, metrics) -> None:
        """Running device-side sums, updated in place (so CUDA graphs keep updating the same
        tensors): no host read until `read_metrics`."""
        current = (metrics.requested_per_expert.long(), metrics.kept_per_expert.long(),
                   metrics.dropped_routes.long(), metrics.buffer_fill.float(),
                   torch.ones((), dtype=torch.long, device=metrics.dropped_routes.device))
        if self._metrics is None:
            self._metrics = [torch.zeros_like(t) for t in current]
        for total, value in zip(self._metrics, current):
            total.add_(value)

    def read_metrics(self, reset: bool = True) -> dict | None:
        """Host copy of the routing metrics since the last read (synchronizes: logging steps only)."""
        if self._metrics is None:
            return None
        requested, kept, dropped, fill, steps = (t.to("cpu", copy=True) for t in self._metrics)
        if reset:
            for total in self._metrics:
                total.zero_()
        n = int(steps)
        if n == 0:
            return None
        dispatcher = self.token_dispatcher
        kept_routes = dispatcher.routes_per_step * n - int(dropped)  # this rank's routes that moved
        return {"steps": n, "requested_per_expert": requested.tolist(), "kept_per_expert": kept.tolist(),
                "dropped_routes": int(dropped), "mean_buffer_fill": float(fill) / n,
                "capacity": dispatcher.capacity, "dispatch_row_bytes": dispatcher.row_bytes,
                "dispatch_buffer_bytes": dispatcher.capacity * dispatcher.row_bytes,
                "dispatched_bytes_per_step": kept_routes * dispatcher.row_bytes // n}
