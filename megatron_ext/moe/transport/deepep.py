"""DeepEP row transport: the four transfers through DeepEP V1's intranode `deep_ep.Buffer`.

dispatch           get_dispatch_layout + dispatch(num_worst_tokens=C), probabilities as topk_weights:
                   a new handle per route map
combine            combine(handle): each route's expert row back to its source token
combine_backward   cached dispatch(handle) of the output gradients
dispatch_backward  combine(handle) of the buffer gradient (summed over k at the source) and of the
                   rows' probability gradients (as topk_weights)
Every DeepEP token is one kept route (DeepEP topk 1, its "expert" = the destination rank);
deepep_layout.py orders the sends by destination row and maps DeepEP's receive order onto the
extension's expert-major capacity buffer, so the same device-offset experts read it and the
route map's capacity/drop policy holds (dropped routes get DeepEP id -1 and travel nowhere).

Cost removed (vs Megatron's flex dispatcher over DeepEP): the host-visible per-expert count
list and the host wait behind it: `num_worst_tokens = C` sizes every output statically
(a rank never receives more than C kept routes), so dispatch, combine and their backward
need no host value. (The layer's route-count exchange over this transport is an NCCL
all-gather, so the graph runner refuses deepep at EP > 1: cuda_graphs/blockers.transport_blocker.)
Vs the torch reference transport: only kept rows travel, with no zero-filled [M, C, H] blocks.
Router probabilities travel as DeepEP's topk_weights: dispatch carries each route's probability
to its row, and the dispatch backward's combine brings each row's probability gradient back.
Costs accepted:
  - one DeepEP token per route, not per (token, rank): a token whose several experts share a
    rank travels once per expert. Since the experts apply the probabilities, DeepEP's native
    per-rank reduction could now sum a token's rows on the expert side (not done yet).
  - a [T*K, H] gather into send order at the source and a [C, H] permutation at the receiver
    per transfer (the symm transport writes rows in place), plus DeepEP's own NVLink buffer,
    shared by every layer of the EP group.
  - combine sums a token's routes at the source in fp32 (as the torch and symm transports do),
    so the numbers match the torch transport: combine of a single row per token is exact in
    DeepEP's fp32 accumulator.
MXFP8 payloads (dispatch_quantized) travel as packed 16-byte-aligned rows, bit-exact; DeepEP's
own FP8 tuple format (E4M3 + per-128 fp32 scales) is not used.
Limits of the real package (V1): combine reduces bf16 rows only (checked up front; a stand-in
module may widen `combine_dtypes`), rows must be multiples of 16 bytes (dispatched rows: of 32 bytes,
at most 16352: bf16 hidden <= 8176, so not 8192), EP groups of 2, 4 or 8
ranks inside one NVLink domain (V1's internode path cannot take num_worst_tokens, i.e. would
synchronize with the host; V2 ElasticBuffer with device prefix sums is future work).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import sum_routes
from megatron_ext.moe.transport.deepep_layout import (
    DeepEPLayout, build_layout, place_received, returned_routes, rows_to_return, send_rows)

INTRANODE_RANKS = (2, 4, 8)  # DeepEP V1 intranode kernels are instantiated for these group sizes
ROW_ALIGN_BYTES = 16
# DeepEP V1 (v1.2.1 and 567632d) csrc/kernels/intranode.cu, dispatch on SM90: EP_DEVICE_ASSERT(hidden_int4 % 2 == 0
# and half_hidden_bytes + sizeof(uint64_t) <= kNumTMABytesPerWarp), kNumTMABytesPerWarp = 8192.
DISPATCH_TMA_BYTES_PER_WARP = 8192
MAX_DISPATCH_ROW_BYTES = (DISPATCH_TMA_BYTES_PER_WARP - 8) // 16 * 32  # 16352: half a row in 16-byte units + 8


def dispatch_row_fits(row_bytes: int) -> bool:
    """Whether DeepEP V1's intranode dispatch kernel takes rows of `row_bytes` (see above)."""
    return row_bytes % 32 == 0 and row_bytes // 2 + 8 <= DISPATCH_TMA_BYTES_PER_WARP


class DeepEPExchange:
    """One shared `deep_ep.Buffer` per EP group, sized from DeepEP's own hints for the widest row.

    Creating a Buffer is collective (it exchanges IPC handles) and so is destroying one (a
    device barrier); every rank of the group reaches the same first dispatch, and the same
    wider row, in the same order, so the lazily created buffer, and its replacement by a wider
    one, stay in step. Both synchronize with the host: callers reserve the widest row up front
    (`reserve`), so a replacement is a fallback, never part of a captured step. Handles do not
    point into the buffer, so a handle outlives a replacement.
    """

    def __init__(self, deep_ep, group, num_ranks: int):
        self.deep_ep, self.group, self.num_ranks = deep_ep, group, num_ranks
        self.index_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.combine_dtypes = tuple(getattr(deep_ep, "combine_dtypes", (torch.bfloat16,)))
        self.buffer = None
        self.row_bytes = 0

    def _buffer_for(self, rows: torch.Tensor, dispatch: bool = False):
        row_bytes = rows.shape[1] * rows.element_size()
        if row_bytes % ROW_ALIGN_BYTES:
            raise ValueError(f"DeepEP moves rows in 16-byte units; a row of {rows.shape[1]} {rows.dtype} values "
                             f"is {row_bytes} bytes. Use a hidden size that makes rows a multiple of 16 bytes "
                             f"(bf16: hidden % 8 == 0), or --moe-ext-transport symm/torch")
        if dispatch and not dispatch_row_fits(row_bytes):
            raise ValueError(f"DeepEP V1's intranode dispatch (SM90 build) stages half a row per warp in "
                             f"{DISPATCH_TMA_BYTES_PER_WARP} bytes of shared memory: rows must be a multiple of 32 "
                             f"bytes and at most {MAX_DISPATCH_ROW_BYTES} bytes (the kernel traps otherwise), but a "
                             f"row of {rows.shape[1]} {rows.dtype} values is {row_bytes} bytes (the backward "
                             f"dispatches bf16 output gradients too). Use --moe-ext-transport symm or torch")
        return self.reserve(row_bytes)

    def reserve(self, row_bytes: int):
        """The shared buffer, (re)created if it cannot hold rows of `row_bytes` (collective)."""
        if self.buffer is None or row_bytes > self.row_bytes:
            buffer_type, ranks = self.deep_ep.Buffer, self.num_ranks
            configs = (buffer_type.get_dispatch_config(ranks), buffer_type.get_combine_config(ranks))
            nvl_bytes = max(config.get_nvl_buffer_size_hint(row_bytes, ranks) for config in configs)
            self.buffer = buffer_type(self.group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=0)
            self.row_bytes = row_bytes
        return self.buffer

    def dispatch(self, send: torch.Tensor, send_rank: torch.Tensor, send_weights: torch.Tensor, capacity: int):
        """New layout: [N, H] rows, [N, 1] destination ranks (-1 nowhere) and [N, 1] fp32 weights (the
        routes' probabilities, DeepEP's topk_weights) -> ([C, H] received, [C, 1] weights, handle)."""
        buffer = self._buffer_for(send, dispatch=True)
        topk_idx = send_rank.to(self.index_dtype)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, self.num_ranks)
        received, _, received_weights, _, handle, _ = buffer.dispatch(
            send, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=send_weights, num_worst_tokens=capacity)
        return received, received_weights, handle

    def dispatch_cached(self, send: torch.Tensor, handle, capacity: int) -> torch.Tensor:
        received, *_ = self._buffer_for(send, dispatch=True).dispatch(send, handle=handle, num_worst_tokens=capacity)
        return received

    def combine(self, rows: torch.Tensor, handle, weights: torch.Tensor | None = None):
        """[C, H] rows in received order (and optionally [C, 1] fp32 weights, DeepEP's topk_weights) ->
        ([N, H] per source token, summed over the ranks it went to; [N, 1] weights or None)."""
        if rows.dtype not in self.combine_dtypes:
            raise TypeError(f"DeepEP V1 combine reduces {', '.join(map(str, self.combine_dtypes))} rows; this "
                            f"layer combines {rows.dtype}. Train the MoE layers in bf16 "
                            f"(--bf16) or use --moe-ext-transport symm/torch")
        combined, combined_weights, _ = self._buffer_for(rows).combine(rows, handle, topk_weights=weights)
        return combined, combined_weights


class LocalExchange:
    """One rank (EP=1): DeepEP's results without DeepEP. Kept routes lead the send list in
    ascending row order, so received token j is send row j; the handle is the send count."""

    @staticmethod
    def _fit(rows: torch.Tensor, length: int) -> torch.Tensor:
        if rows.shape[0] >= length:
            return rows[:length].contiguous()
        return torch.cat([rows, rows.new_zeros(length - rows.shape[0], rows.shape[1])])

    def reserve(self, row_bytes: int) -> None:
        pass

    def dispatch(self, send, send_rank, send_weights, capacity):
        return self._fit(send, capacity), self._fit(send_weights, capacity), send.shape[0]

    def dispatch_cached(self, send, handle, capacity):
        return self._fit(send, capacity)

    def combine(self, rows, handle, weights=None):
        return self._fit(rows, handle), None if weights is None else self._fit(weights, handle)


_shared_exchanges: dict[int, DeepEPExchange] = {}


def shared_exchange(deep_ep, group, num_ranks: int) -> DeepEPExchange:
    """The EP group's DeepEP buffer, shared by all its MoE layers (one NVLink buffer, not one per layer)."""
    key = id(group)
    if key not in _shared_exchanges or _shared_exchanges[key].deep_ep is not deep_ep:
        _shared_exchanges[key] = DeepEPExchange(deep_ep, group, num_ranks)
    return _shared_exchanges[key]


@dataclass
class _RouteState:
    layout: DeepEPLayout
    handle: object = None


class DeepEPRowTransport:
    """Rows through DeepEP V1 intranode dispatch/combine, landing in the rowwise capacity buffer."""

    def __init__(self, group, capacity: int, poison_tail: bool = False):
        self.size = 1 if group is None else dist.get_world_size(group)
        if capacity < 1:
            raise ValueError(f"the DeepEP transport sizes its receive side with num_worst_tokens = capacity, "
                             f"which must be >= 1 (got {capacity}); raise --moe-ext-capacity-factor")
        self.capacity = capacity
        self.tail_value = float("nan") if poison_tail else 0.0
        self._states: dict[int, _RouteState] = {}
        if self.size == 1:
            self.exchange = LocalExchange()
            return
        if self.size not in INTRANODE_RANKS:
            raise ValueError(f"DeepEP V1 intranode kernels run on EP groups of {INTRANODE_RANKS} ranks; this EP "
                             f"group has {self.size}. Choose --expert-model-parallel-size 2, 4 or 8, or "
                             f"--moe-ext-transport torch")
        from megatron_ext.moe.transport import group_in_one_host

        if not group_in_one_host(group):
            raise ValueError("transport='deepep' drives DeepEP V1's intranode path (num_worst_tokens: no host "
                             "sync), which needs the EP group inside one NVLink domain; this group spans "
                             "hosts. V1's internode dispatch synchronizes with the host and V2 ElasticBuffer "
                             "is not wired in this build: use --moe-ext-transport torch across hosts")
        import deep_ep

        self.exchange = shared_exchange(deep_ep, group, self.size)

    # Per-route-map state: the layout (built once, reused by all four transfers) and DeepEP's
    # handle from the forward dispatch. Dropped when the route map is garbage collected.
    def _state(self, route: RouteMap) -> _RouteState:
        key = id(route)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _RouteState(build_layout(route, self.size, self.capacity))
            weakref.finalize(route, self._states.pop, key, None)
        return state

    def _dispatched(self, route: RouteMap) -> _RouteState:
        state = self._states.get(id(route))
        if state is None or state.handle is None:
            raise RuntimeError("DeepEP transport: combine or backward for a route map this transport never "
                               "dispatched; DeepEP's handle comes from dispatch(tokens, route) of the same map")
        return state

    # The four transfers (transport/base.py); autograd owns every buffer, so no leases.
    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, route: RouteMap):
        state = self._state(route)
        send = send_rows(tokens.contiguous(), state.layout)
        send_probs = probs.float().reshape(-1).index_select(0, state.layout.send_route)[:, None]
        received, received_probs, state.handle = self.exchange.dispatch(send, state.layout.send_rank, send_probs,
                                                                        self.capacity)
        rows = place_received(received, state.layout, self.tail_value)
        return rows, place_received(received_probs, state.layout, self.tail_value)[:, 0], None

    def dispatch_quantized(self, tokens: torch.Tensor, probs: torch.Tensor, route: RouteMap):
        """MXFP8 rows: quantize and pack [T, H] tokens, dispatch the packed rows as float32 words
        (DeepEP copies bytes: bit-exact). Returns (uint8 [C, packed_row_bytes(H)], probs [C], None)."""
        from megatron_ext.kernels.mxfp8_rows import quantize_packed

        self.exchange.reserve(tokens.shape[1] * tokens.element_size())  # combine rows, wider than packed
        packed = quantize_packed(tokens.contiguous())
        buffer, row_probs, lease = self.dispatch(packed.view(torch.float32), probs, route)
        return buffer.view(torch.uint8), row_probs, lease

    def combine(self, expert_out: torch.Tensor, route: RouteMap) -> torch.Tensor:
        state = self._dispatched(route)
        combined, _ = self.exchange.combine(rows_to_return(expert_out, state.layout), state.handle)
        return sum_routes(returned_routes(combined, state.layout))

    def combine_backward(self, grad_out: torch.Tensor, route: RouteMap) -> torch.Tensor:
        state = self._dispatched(route)
        received = self.exchange.dispatch_cached(send_rows(grad_out.contiguous(), state.layout), state.handle,
                                                 self.capacity)
        return place_received(received, state.layout, self.tail_value)

    def dispatch_backward(self, grad_buffer: torch.Tensor, grad_row_probs: torch.Tensor | None, route: RouteMap):
        state = self._dispatched(route)
        weights = None if grad_row_probs is None else rows_to_return(grad_row_probs.float()[:, None], state.layout)
        combined, combined_weights = self.exchange.combine(rows_to_return(grad_buffer, state.layout), state.handle,
                                                           weights)
        grad_tokens = sum_routes(returned_routes(combined, state.layout))
        if grad_row_probs is None:
            return grad_tokens, None
        return grad_tokens, returned_routes(combined_weights, state.layout)[..., 0]

    def release(self, lease) -> None:
        pass
