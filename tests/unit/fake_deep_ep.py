"""In-process stand-in for the part of DeepEP V1 that the deepep transport calls (tests only).

Install it with `install()` (sys.modules['deep_ep'] = this module) inside a gloo rank. It
follows the documented V1 intranode semantics of `deep_ep.Buffer` (deep_ep/buffer.py at
v1.2.1, `deep_ep/buffers/legacy.py` on main), moving rows with torch.distributed collectives:
  get_dispatch_layout(topk_idx, num_experts) -> per-rank / per-expert counts, is_token_in_rank
  dispatch(x, ...)  a token goes once to every rank holding one of its experts; received tokens
      are grouped by source rank (rank 0 first), each source's tokens in its own order; topk
      ids arrive local to the receiver (-1 for experts elsewhere) with their weights zeroed;
      num_worst_tokens > 0: outputs have that many rows, the topk-id tail is -1, the row tail is
      left unwritten (NaN here, garbage in DeepEP), no host count list; with a handle: the
      cached layout, no topk allowed
  combine(x, handle) -> each received row back to its source token, summed in fp32 over the
      ranks the token went to (rank order), cast back; tokens sent nowhere get zeros
  handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
            recv_src_idx, is_token_in_rank, send_head)
It also checks what DeepEP asserts on (dtypes, shapes, 16-byte rows, buffer size from the
NVL size hint, more received tokens than num_worst_tokens).
Differences, on purpose: it synchronizes with the host (CPU collectives need split sizes);
channel matrices are placeholders (one cumulative count per rank); and combine also accepts
fp32 (`combine_dtypes`) so the CPU parity tests can hold 1e-5: real V1 combines bf16 only.
Every call is appended to `calls` for the tests.
"""

from __future__ import annotations

import math
import sys
import types

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
combine_dtypes = (torch.bfloat16, torch.float32)
calls: list[dict] = []
NUM_MAX_TOPK, NUM_MAX_SCALES = 128, 128


def install() -> None:
    sys.modules["deep_ep"] = sys.modules[__name__]
    sys.modules["deep_ep.utils"] = utils


def install_for_megatron() -> None:
    """install(), then rebind megatron-core 0.19.2's DeepEP entry points, which its fused_a2a
    module resolved (to None) when it was imported without deep_ep: reload fused_a2a and point
    the flex dispatcher's module-level names at the reloaded functions."""
    import importlib

    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    install()
    fused_a2a = importlib.reload(fused_a2a)
    assert fused_a2a.HAVE_DEEP_EP, "megatron's fused_a2a did not pick up the fake deep_ep"
    for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
        assert hasattr(token_dispatcher, name), f"megatron-core moved token_dispatcher.{name}"
        setattr(token_dispatcher, name, getattr(fused_a2a, name))


class Config:
    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int):
        assert num_sms >= 0 and 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens

    def _slots(self, num_ranks: int) -> int:
        return (self.num_sms // 2) * num_ranks * self.num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        per_slot = hidden_bytes + NUM_MAX_TOPK * (8 + 4) + NUM_MAX_SCALES * 4
        size = (self.num_sms // 2) * num_ranks * 5 * 4 + self._slots(num_ranks) * per_slot
        return -(-size // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # intranode only

    def data_bytes(self, row_bytes: int, num_topk: int, num_ranks: int) -> int:
        """What one dispatch/combine needs from the NVL buffer (DeepEP's EP_HOST_ASSERT)."""
        return self._slots(num_ranks) * (row_bytes + 4 + num_topk * (8 + 4))


class EventHandle:
    """deep_ep.utils.EventHandle: an event recorded on the current stream (nothing to record here)."""


class EventOverlap:
    def __init__(self, event=None, extra_tensors=None):
        self.event = event

    def current_stream_wait(self) -> None:
        pass


utils = types.ModuleType("deep_ep.utils")  # what megatron imports: from deep_ep.utils import EventHandle, EventOverlap
utils.EventHandle, utils.EventOverlap = EventHandle, EventOverlap


def _configs(table):
    return {n: Config(Buffer.num_sms, *values) for n, values in table.items()}


class Buffer:
    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None):
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        assert not low_latency_mode and num_rdma_bytes == 0, "the fake covers the intranode path only"
        assert num_nvl_bytes % 128 == 0, "num_nvl_bytes must be aligned to 128 bytes"
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        dist.barrier(group=group)  # DeepEP exchanges IPC handles here: collective
        calls.append(dict(op="Buffer", num_nvl_bytes=num_nvl_bytes))

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        table = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return _configs(table)[num_ranks]

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        table = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return _configs(table)[num_ranks]

    # ---- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t
        assert num_experts > 0 and num_experts % self.group_size == 0
        per_rank_experts = num_experts // self.group_size
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // per_rank_experts, -1)
        is_token_in_rank = torch.stack([(rank_of == r).any(1) for r in range(self.group_size)], 1).contiguous()
        num_tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int64)
        num_tokens_per_expert.scatter_add_(0, torch.where(valid, topk_idx, num_experts).reshape(-1),
                                           torch.ones(topk_idx.numel(), dtype=torch.int64))
        calls.append(dict(op="get_dispatch_layout", num_experts=num_experts))
        return (is_token_in_rank.sum(0).int(), None, num_tokens_per_expert[:num_experts].int(), is_token_in_rank,
                EventOverlap())

    # ---- transfers
    def _all_to_all_rows(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of any dtype, moved as bytes (block r to rank r; blocks arrive in source-rank order)."""
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        # a fresh contiguous copy: an empty slice of an expanded tensor keeps stride 0, which .view refuses
        raw = torch.empty(rows.shape, dtype=rows.dtype).copy_(rows).view(torch.uint8).reshape(rows.shape[0], row_bytes)
        out = raw.new_empty(sum(recv_counts), row_bytes)
        dist.all_to_all_single(out, raw, recv_counts, send_counts, group=self.group)
        return out.view(rows.dtype).reshape(out.shape[0], *rows.shape[1:])

    def _send_lists(self, is_token_in_rank: torch.Tensor) -> list[torch.Tensor]:
        return [torch.nonzero(is_token_in_rank[:, r]).reshape(-1) for r in range(self.group_size)]

    def _count_matrix(self, send_counts: list[int]) -> torch.Tensor:
        """[M, M]: tokens source s sends to rank d (all ranks)."""
        mine = torch.tensor(send_counts, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.group_size)]
        dist.all_gather(gathered, mine, group=self.group)
        return torch.stack(gathered)

    def _check_room(self, rows: torch.Tensor, num_topk: int, config: Config) -> None:
        needed = config.data_bytes(rows.shape[1] * rows.element_size(), num_topk, self.group_size)
        assert needed <= self.num_nvl_bytes, (f"DeepEP buffer too small: {needed} > {self.num_nvl_bytes} bytes "
                                              f"for rows of {rows.shape[1] * rows.element_size()} bytes")

    @staticmethod
    def _pad(rows: torch.Tensor, length: int, value) -> torch.Tensor:
        """Stand-in for rows DeepEP leaves unwritten: NaN (floating rows) or `value`."""
        value = float("nan") if rows.is_floating_point() and value is None else (0 if value is None else value)
        tail = rows.new_full((length - rows.shape[0], *rows.shape[1:]), value)
        return torch.cat([rows, tail])

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        if isinstance(x, tuple):
            raise NotImplementedError("fake deep_ep: FP8 (values, scales) payloads are not modelled")
        assert x.dim() == 2 and x.is_contiguous()
        row_bytes = x.shape[1] * x.element_size()
        # V1's SM90 dispatch kernel: EP_DEVICE_ASSERT(hidden_int4 % 2 == 0 and half_hidden_bytes + 8 <= 8192)
        assert row_bytes % 32 == 0 and row_bytes // 2 + 8 <= 8192, f"DeepEP dispatch traps on rows of {row_bytes} bytes"
        config = config or self.get_dispatch_config(self.group_size)
        cached = handle is not None
        if cached:
            assert topk_idx is None and topk_weights is None
            rank_prefix_matrix, _, _, cached_src_idx, is_token_in_rank, _ = handle
            num_recv = cached_src_idx.shape[0]
        else:
            assert num_tokens_per_rank is not None and num_tokens_per_expert is not None
            assert num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32
            assert num_tokens_per_expert.shape[0] % self.group_size == 0
            assert (topk_idx is None) == (topk_weights is None)
            if num_worst_tokens > 0:
                assert topk_idx is not None, "num_worst_tokens needs topk_idx and topk_weights (forward)"
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.shape == (x.shape[0], self.group_size)
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        self._check_room(x, num_topk, config)

        send_lists = self._send_lists(is_token_in_rank)
        send_counts = [int(s.numel()) for s in send_lists]
        counts = self._count_matrix(send_counts)
        recv_counts = counts[:, self.rank].tolist()
        received = sum(recv_counts)
        order = torch.cat(send_lists)
        recv_x = self._all_to_all_rows(x.index_select(0, order), send_counts, recv_counts)
        calls.append(dict(op="dispatch", cached=cached, num_worst_tokens=num_worst_tokens, rows=x.shape[0],
                          received=received))
        if cached:
            assert received <= num_recv, f"cached dispatch receives {received} tokens > {num_recv} (handle)"
            return self._pad(recv_x, num_recv, None), None, None, None, None, EventOverlap()

        recv_src_idx = self._all_to_all_rows(order.int(), send_counts, recv_counts)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            assert topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32
            assert topk_idx.shape == topk_weights.shape and topk_idx.shape[0] == x.shape[0]
            local = num_tokens_per_expert.shape[0] // self.group_size
            dest = torch.cat([torch.full((n,), r) for r, n in enumerate(send_counts)]).long()
            idx = topk_idx.index_select(0, order)
            here = (idx >= (dest * local)[:, None]) & (idx < ((dest + 1) * local)[:, None])
            send_idx = torch.where(here, idx - (dest * local)[:, None], -1)
            send_weights = torch.where(here, topk_weights.index_select(0, order), 0.0)
            recv_topk_idx = self._all_to_all_rows(send_idx, send_counts, recv_counts)
            recv_topk_weights = self._all_to_all_rows(send_weights, send_counts, recv_counts)

        per_expert_list = []
        if num_worst_tokens > 0:
            if received > num_worst_tokens:
                raise RuntimeError(f"fake deep_ep: rank {self.rank} receives {received} tokens but "
                                   f"num_worst_tokens={num_worst_tokens}: DeepEP would write past its outputs")
            num_recv = num_worst_tokens
            recv_x = self._pad(recv_x, num_recv, None)
            recv_src_idx = self._pad(recv_src_idx, num_recv, -1)
            if recv_topk_idx is not None:
                recv_topk_idx = self._pad(recv_topk_idx, num_recv, -1)
                recv_topk_weights = self._pad(recv_topk_weights, num_recv, float("nan"))
        elif recv_topk_idx is not None:
            local = num_tokens_per_expert.shape[0] // self.group_size
            for e in range(local):
                n = int((recv_topk_idx == e).any(1).sum())
                per_expert_list.append(-(-n // expert_alignment) * expert_alignment)

        rank_prefix_matrix = torch.cumsum(counts, 0).int()
        num_channels = config.num_sms // 2
        channel_prefix_matrix = torch.tensor(send_counts, dtype=torch.int32)[:, None].repeat(1, num_channels)
        recv_channel_prefix_matrix = torch.tensor(recv_counts, dtype=torch.int32)[:, None].repeat(1, num_channels)
        send_head = torch.full((x.shape[0], self.group_size), -1, dtype=torch.int32)
        for r, tokens in enumerate(send_lists):
            send_head[tokens, r] = torch.arange(tokens.numel(), dtype=torch.int32)
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head)
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, handle, EventOverlap()

    def combine(self, x: torch.Tensor, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        rank_prefix_matrix, _, _, src_idx, is_token_in_rank, _ = handle
        assert x.dim() == 2 and x.is_contiguous() and x.shape[0] == src_idx.shape[0]
        assert (x.shape[1] * x.element_size()) % 16 == 0, "DeepEP rows must be multiples of 16 bytes"
        assert x.dtype in combine_dtypes, f"Unsupported type {x.dtype} (DeepEP V1 combines bfloat16 only)"
        config = config or self.get_combine_config(self.group_size)
        self._check_room(x, 0 if topk_weights is None else topk_weights.shape[1], config)
        column = rank_prefix_matrix[:, self.rank].long()
        back_counts = torch.diff(column, prepend=column.new_zeros(1)).tolist()  # rows I got from each source
        send_lists = self._send_lists(is_token_in_rank)
        home_counts = [int(s.numel()) for s in send_lists]  # rows coming home from each rank
        received = sum(back_counts)
        home = self._all_to_all_rows(x[:received], back_counts, home_counts)
        num_tokens = is_token_in_rank.shape[0]
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
        for b in bias if isinstance(bias, tuple) else ([bias] if bias is not None else []):
            out += b.float()
        starts = [0] + torch.cumsum(torch.tensor(home_counts), 0).tolist()
        for r, tokens in enumerate(send_lists):  # DeepEP adds the ranks' rows in rank order, in fp32
            out.index_add_(0, tokens, home[starts[r]:starts[r + 1]].float())
        combined_weights = None
        if topk_weights is not None:
            home_w = self._all_to_all_rows(topk_weights[:received].contiguous(), back_counts, home_counts)
            combined_weights = torch.zeros(num_tokens, topk_weights.shape[1], dtype=torch.float32)
            for r, tokens in enumerate(send_lists):
                combined_weights.index_add_(0, tokens, home_w[starts[r]:starts[r + 1]])
        calls.append(dict(op="combine", rows=x.shape[0], returned=num_tokens))
        return out.to(x.dtype), combined_weights, EventOverlap()
