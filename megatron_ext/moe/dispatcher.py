"""RowwiseTokenDispatcher: Megatron's MoETokenDispatcher interface over device route maps.

Megatron's alltoall dispatcher permutes rows per peer, waits on the host for split sizes, runs
a variable-split all-to-all, then permutes again. Here every step stays on the device:
  dispatch_preprocess  routing_map [T, E] -> top-k expert ids [T, K] and their probs (fp32), or
                       FusedTopKRouter's selection and top-k probs as they are
  token_dispatch       route map (one [E] count all-gather), PUT rows and their probs into
                       capacity buffers
  dispatch_postprocess the buffer itself, per-local-expert counts on the device and each row's
                       probability, which the experts apply (Megatron's permuted_probs)
  token_combine        GET the K expert rows per token, summed in fp32
Written against megatron-core 0.19.2 (MoETokenDispatcher in transformer/moe/token_dispatcher.py).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_ext.config import MoEExtConfig
from megatron_ext.moe import fused_routes
from megatron_ext.moe.capacity import rank_capacity
from megatron_ext.moe.expert_rows import RowGroups
from megatron_ext.moe.mxfp8_dispatch import dispatch_row_bytes, dispatch_rows_mxfp8
from megatron_ext.moe.peer_failure import named_phase, peer_timeout_seconds
from megatron_ext.moe.route_map import RouteMap, check_route_map, route
from megatron_ext.moe.row_autograd import combine_rows, dispatch_rows
from megatron_ext.moe.transport import make_transport


def routing_map_to_topk(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, E] bool with K selected experts per token -> [T, K] int64 ids in ascending order; a
    token with fewer than K selected gets -1 in its last slots (as the fused select does), not
    experts it did not pick.

    Ascending order makes the (t, k) order, and with it "earlier routes win" inside a bucket,
    deterministic on every device.
    """
    picked, ids = torch.topk(routing_map.to(torch.float32), topk, dim=1, sorted=False)
    num_experts = routing_map.shape[1]
    ids = torch.sort(torch.where(picked > 0, ids, num_experts), dim=1).values  # empty slots sort last
    return torch.where(ids < num_experts, ids, -1)


def topk_probs(probs: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """[T, E] router probabilities at the [T, K] top-k ids -> [T, K] fp32, 0 in empty slots (-1), as
    the fused select writes them. A where, not a product with the mask: a NaN at an expert the token did
    not pick (Megatron's token drop leaves NaN * 0 there) would survive NaN * 0 into the slot and into
    the non-finite route count, which counts selected routes only."""
    return torch.where(top_idx >= 0, probs.gather(1, top_idx.clamp(min=0)).float(), 0.0)


class RowwiseTokenDispatcher(MoETokenDispatcher):
    """Device-only dispatcher: capacity buffers in, capacity buffers out, no host waits."""

    def __init__(self, num_local_experts: int, local_expert_indices, config, ext_config: MoEExtConfig,
                 pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.ext_config = ext_config
        self.max_tokens = ext_config.max_tokens_per_rank
        self.transport = None  # built at the first forward, once T_max (hence C) is known
        self.route_map: RouteMap | None = None
        self.row_bytes = 0  # bytes per dispatched row (BF16 or packed MXFP8), set at dispatch
        self.routes_per_step = 0
        self.top_idx: torch.Tensor | None = None
        self.selection: fused_routes.Selection | None = None  # from dispatch_preprocess to token_dispatch
        self.payload = None  # MXFP8 payload between token_dispatch and dispatch_postprocess
        self.arena_layer = None  # moe/arena.ArenaLayer with dropless_arena (set by attach_arenas)
        self.arena_rows = None  # this forward's rows in the arena, from token_dispatch to dispatch_postprocess
        # Where the layer wants this forward's route metrics (moe/metric_sinks.MetricSinks), handed for
        # one forward: the route consumes them, so a recomputed forward (--recompute-modules moe) adds nothing.
        self.metric_sinks = None
        self.cudagraph_attrs = ["route_map", "top_idx"]

    @property
    def capacity(self) -> int:
        return self.transport.capacity

    def _ensure_transport(self, num_tokens: int, device: torch.device) -> None:
        if self.max_tokens is None:  # static in Megatron training: every microbatch has this shape
            self.max_tokens = self._agreed_max_tokens(num_tokens, device)
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"this rank holds {num_tokens} tokens in a microbatch but the rowwise MoE capacity was "
                f"sized for max_tokens_per_rank={self.max_tokens}; raise --moe-ext-max-tokens-per-rank "
                f"(MoEExtConfig.max_tokens_per_rank) to at least {num_tokens}")
        if self.transport is None:
            if self.ext_config.dropless_arena:
                capacity = self._arena_capacity()
            else:
                capacity = rank_capacity(self.max_tokens, self.topk, self.ep_size,
                                         self.ext_config.capacity_factor, self.ext_config.dropless)
            self.transport = make_transport(self.ext_config, self.ep_group, capacity, device,
                                            max_routes=self.max_tokens * self.topk)
            if self.arena_layer is not None:
                self.transport.slot_source = self.arena_layer.lease

    def _agreed_max_tokens(self, num_tokens: int, device: torch.device) -> int:
        """T_max from the first microbatch, the largest of the EP group's: every rank's capacity,
        hence its buffers, collective allocations and exchange sizes, must agree (ranks whose first
        microbatches differ in size would otherwise fail in their first exchange). One all-reduce,
        at the layer's first forward only (init time, not a step's)."""
        if self.ep_size == 1:
            return num_tokens
        largest = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        with named_phase("first-forward agreement on the largest microbatch", self.ep_group,
                         peer_timeout_seconds(None)):
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
            return int(largest.item())

    def _arena_capacity(self) -> int:
        if self.arena_layer is None:
            raise RuntimeError("dropless_arena: this MoE layer has no arena; call "
                               "megatron_ext.moe.arena.attach_arenas(model) once the model is built (megatron.training "
                               "runs under megatron_ext do it at the first step)")
        self.arena_layer.arena.configure(self.max_tokens, self.topk)
        return self.arena_layer.capacity

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Tokens keep their [S, B, H] shape (the dispatch node flattens them, no view node)."""
        self.hidden_shape = tokens.shape
        first_forward = self.transport is None
        self._ensure_transport(tokens.numel() // tokens.shape[-1], tokens.device)
        if first_forward and self.arena_layer is not None:  # once per layer, in the same order on every rank
            self._allocate_arena(tokens)
        if isinstance(routing_map, fused_routes.Selection):  # FusedTopKRouter selected already
            self.top_idx, top_probs, self.selection = routing_map.top_idx, probs, routing_map
        elif self.ext_config.fused_route_map and tokens.is_cuda:
            self.top_idx, top_probs, self.selection = fused_routes.select(routing_map, probs, self.topk)
        else:
            self.top_idx, self.selection = routing_map_to_topk(routing_map, self.topk), None
            top_probs = topk_probs(probs, self.top_idx)
        return tokens, top_probs  # moe_apply_probs_on_input: the experts scale their input rows

    def token_dispatch(self, hidden: torch.Tensor, probs: torch.Tensor):
        group = self.ep_group if self.ep_size > 1 else None
        sinks, self.metric_sinks = self.metric_sinks, None
        # Set before the route adds to the metric sums, so read_metrics can count a forward that fails after it
        self.routes_per_step = self.top_idx.numel()
        self.row_bytes = dispatch_row_bytes(hidden.shape[-1], hidden.dtype, self.ext_config.mxfp8_dispatch)
        gather_counts = getattr(self.transport, "gather_counts", None)
        probs = self._keep_dispatch_backward(hidden, probs)
        # With the arena the plan's capacities come from the microbatch's cursor, which the plan moves.
        cursor = None if self.arena_layer is None else \
            self.arena_layer.begin_forward(dispatch_has_backward=hidden.requires_grad or probs.requires_grad)
        if self.selection is not None:  # the fused kernel reads and moves the cursor in its launch
            self.route_map = fused_routes.route(self.selection, self.topk, self.capacity, group, gather_counts,
                                                need_row_source=getattr(self.transport, "reads_row_source", True),
                                                arena=cursor, sinks=sinks)
            self.selection = None
        else:
            self.route_map = route(self.top_idx, self.num_experts, self.capacity, group, gather_counts=gather_counts,
                                   probs=probs, dest_capacity=None if cursor is None else cursor.capacities())
            if cursor is not None:
                cursor.advance(self.route_map.metrics.kept_per_expert)
            if sinks is not None:  # the fused launch adds them itself
                sinks.add(self.route_map.metrics, self.ep_size)
        if cursor is not None:
            self.arena_rows = self.arena_layer.rows(cursor)
        if self.ext_config.debug_checks:  # host reads: debug only
            check_route_map(self.route_map, self.top_idx, self.num_experts, self.capacity, self.ep_size)
        if self.ext_config.mxfp8_dispatch:
            buffer, row_probs, self.payload, self.lease = dispatch_rows_mxfp8(
                hidden.reshape(-1, hidden.shape[-1]), probs, self.transport, self.route_map)
        else:
            (buffer, row_probs, self.lease), self.payload = dispatch_rows(hidden, probs, self.transport,
                                                                         self.route_map), None
        return buffer, row_probs

    def _allocate_arena(self, hidden: torch.Tensor) -> None:
        """The arena's storage, at the layer's first forward (collective with the symm transport's heap;
        later layers check that their rows match it)."""
        transport = self.transport
        heap = getattr(transport, "heap", None)
        world = getattr(transport, "world", self.ep_size)
        rank = getattr(transport, "rank", None)
        if rank is None:
            rank = self.ep_group.rank() if self.ep_size > 1 else 0
        self.arena_layer.arena.allocate(heap, world, rank, hidden.shape[-1], hidden.dtype, hidden.device,
                                        return_ids=getattr(transport, "return_put", False),
                                        fence=getattr(transport, "poison_fence", None))

    def _keep_dispatch_backward(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The dispatch backward frees the dispatch buffer (the symm transport's lease, the arena's
        slot) once the experts' backward has read it. With neither the input nor the router needing
        gradients (layers below and the router frozen, the experts training) autograd would skip
        that node and the buffer would stay taken: the probabilities then enter the dispatch as a
        leaf that needs a gradient, so the node runs. Cost accepted in that case only: the rows'
        gradients are computed and sent back, and dropped at the frozen input."""
        holds_buffer = self.arena_layer is not None or getattr(self.transport, "leases_dispatch_buffers", False)
        if holds_buffer and torch.is_grad_enabled() and not (hidden.requires_grad or probs.requires_grad):
            return probs.detach().requires_grad_()
        return probs

    def dispatch_postprocess(self, hidden: torch.Tensor, row_probs: torch.Tensor):
        # Counts and end offsets stay on the device. An MXFP8 payload goes with them, explicitly
        # (never as an attribute of `hidden`).
        groups = RowGroups(self.route_map.recv_counts, self.route_map.recv_offsets, self.payload, self.arena_rows)
        self.payload = self.arena_rows = None
        return hidden, groups, row_probs

    def combine_preprocess(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def token_combine(self, hidden: torch.Tensor) -> torch.Tensor:
        out = combine_rows(hidden, self.transport, self.route_map, self.hidden_shape)
        if not torch.is_grad_enabled():
            self.transport.release(self.lease)  # no backward will read the dispatch buffer
        self.lease = None
        return out

    def combine_postprocess(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # already [S, B, H] (combine_rows)

    def kept_route_mask(self) -> torch.Tensor:
        """[T, E] bool: which (token, expert) routes of the last forward were kept."""
        kept = torch.zeros(self.top_idx.shape[0], self.num_experts + 1, dtype=torch.bool, device=self.top_idx.device)
        column = torch.where(self.top_idx >= 0, self.top_idx, self.num_experts).long()  # empty slots: spare column
        return kept.scatter_(1, column, self.route_map.dest_row >= 0)[:, :self.num_experts]
