"""Argument checks shared by the row kernels (row_transfer.py, mxfp8_put.py).

Every check raises with what is wrong and what to pass instead. A layout that passed once is
remembered (`VALIDATED`), so a training step, which repeats its shapes, pays a tuple lookup
instead of ~20 checks per launch.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BUFFER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HAVE_TRITON = importlib.util.find_spec("triton") is not None

_NO_ROW_BOUND = 2**31 - 1


def row_bound(capacity: int | None) -> int:
    """The kernels' exclusive upper bound on dest_row (int32 range when the caller gives none)."""
    if capacity is None:
        return _NO_ROW_BOUND
    require(isinstance(capacity, int) and 0 <= capacity <= _NO_ROW_BOUND,
             f"capacity must be an int in [0, 2^31), got {capacity!r}")
    return capacity


def require(cond: bool, message: str, error=ValueError) -> None:
    if not cond:
        raise error(message)


VALIDATED: set = set()  # argument layouts already checked: the hot path re-checks nothing


def layout(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.device, t.is_contiguous())


def check_common(op, rows_like, dest_rank, dest_row, peer_table, per_route=(), values=None, value_table=None,
                 in_place: bool = False):
    """Shape/dtype/layout checks shared by the row kernels; returns (T, K, H). `per_route`: (name,
    [T, K] fp32 tensor or None) pairs; `values`: the (name, tensor) of the per-route values, which
    come with `value_table` (the owners' [C] fp32 arrays) or not at all. `in_place`: `peer_table`
    is one rank's [C, H] rows themselves and `value_table` its [C] fp32 values (no address tables).

    A layout that passed once is remembered, so a training step (same shapes every call)
    pays a tuple lookup instead of ~20 checks per kernel launch.
    """
    if values is not None:
        per_route = (*per_route, values)
    key = (op, layout(rows_like), layout(dest_rank), layout(dest_row), layout(peer_table),
           tuple(layout(t) for _, t in per_route), layout(value_table), in_place)
    if key in VALIDATED:
        return rows_like.shape[0], dest_rank.shape[1], rows_like.shape[1]
    shape = _check_common_uncached(op, rows_like, dest_rank, dest_row, peer_table, per_route, in_place)
    if in_place:
        _check_values_in_place(op, value_table, peer_table, None if values is None else values[1])
    else:
        _check_value_table(op, value_table, peer_table, None if values is None else values[1])
    VALIDATED.add(key)
    return shape


def _check_common_uncached(op, rows_like, dest_rank, dest_row, peer_table, per_route=(), in_place=False):
    require(HAVE_TRITON, f"{op}: Triton is not installed; use megatron_ext.kernels.row_transfer_ref",
             RuntimeError)
    require(rows_like.dim() == 2, f"{op}: rows must be [T, H], got shape {tuple(rows_like.shape)}")
    T, H = rows_like.shape
    for name, t in (("dest_rank", dest_rank), ("dest_row", dest_row)):
        require(t.dtype == torch.int32, f"{op}: {name} must be int32, got {t.dtype}; convert with .to(torch.int32)",
                 TypeError)
        require(t.dim() == 2 and t.shape[0] == T,
                 f"{op}: {name} must be [T={T}, K], got shape {tuple(t.shape)}")
    require(dest_rank.shape == dest_row.shape,
             f"{op}: dest_rank {tuple(dest_rank.shape)} and dest_row {tuple(dest_row.shape)} differ in shape")
    K = dest_rank.shape[1]
    if in_place:  # the source rows themselves
        require(peer_table.dim() == 2 and peer_table.shape[1] == H and peer_table.dtype in BUFFER_DTYPES,
                 f"{op}: in place, the source must be [C, H={H}] rows of {BUFFER_DTYPES}, got "
                 f"{peer_table.dtype} {tuple(peer_table.shape)}")
    else:
        require(peer_table.dtype == torch.int64, f"{op}: peer_table must be int64 base addresses, got "
                 f"{peer_table.dtype}; build it with peer_table_from_buffers", TypeError)
        require(peer_table.dim() == 1 and peer_table.numel() > 0,
                 f"{op}: peer_table must be a non-empty 1-D [M] tensor, got shape {tuple(peer_table.shape)}")
    for name, t in per_route:
        if t is None:
            continue
        require(t.dtype == torch.float32, f"{op}: {name} must be float32, got {t.dtype}", TypeError)
        require(t.shape == dest_rank.shape, f"{op}: {name} must be [T, K] = {tuple(dest_rank.shape)}, "
                 f"got {tuple(t.shape)}")
    tensors = [("rows", rows_like), ("dest_rank", dest_rank), ("dest_row", dest_row), ("peer_table", peer_table)]
    tensors += [(n, t) for n, t in per_route if t is not None]
    for name, t in tensors:
        require(t.is_contiguous(), f"{op}: {name} is not contiguous; pass {name}.contiguous()")
        require(t.device == rows_like.device,
                 f"{op}: {name} is on {t.device} but the rows are on {rows_like.device}; keep all on one device")
    return T, K, H


def check_put_rows_back(src, return_ids, count, peer_table, values) -> None:
    """put_rows_back's arguments (row_transfer.py): src [C, H] rows, return_ids and values_src covering
    C rows, an int32 device count, int64 address tables, everything on src's device. Cached per
    layout like check_common (the call is on the per-layer path)."""
    key = ("put_rows_back", layout(src), layout(return_ids), layout(count), layout(peer_table),
           *(layout(t) for t in values or ()))
    if key in VALIDATED:
        return
    require(src.dim() == 2 and src.is_contiguous() and src.dtype in BUFFER_DTYPES,
            f"put_rows_back: src must be a contiguous [C, H] of {BUFFER_DTYPES}, got {src.dtype} {tuple(src.shape)}")
    require(return_ids.dtype == torch.int32 and return_ids.shape[0] >= src.shape[0] and return_ids.is_contiguous(),
            f"put_rows_back: return_ids must be contiguous int32 with >= {src.shape[0]} entries, got "
            f"{return_ids.dtype} {tuple(return_ids.shape)}")
    require(count.dtype == torch.int32 and count.numel() >= 1,
            f"put_rows_back: count must be a device int32 count, got {count.dtype} of {count.numel()} elements")
    require(peer_table.dtype == torch.int64 and peer_table.dim() == 1 and peer_table.numel() > 0,
            f"put_rows_back: peer_table must be a non-empty int64 [M] of base addresses (peer_table_from_buffers), "
            f"got {peer_table.dtype} {tuple(peer_table.shape)}")
    if values is not None:
        require(values[0].dtype == torch.float32 and values[0].shape == (src.shape[0],) and values[0].is_contiguous(),
                f"put_rows_back: values_src must be a contiguous float32 [{src.shape[0]}], got {values[0].dtype} "
                f"{tuple(values[0].shape)}")
        require(values[1].dtype == torch.int64 and values[1].shape == peer_table.shape,
                f"put_rows_back: value_table must be an int64 [{peer_table.numel()}] table like peer_table, got "
                f"{values[1].dtype} {tuple(values[1].shape)}")
    on_src_device = (return_ids, count, peer_table) + (() if values is None else values)
    require(all(t.device == src.device for t in on_src_device),
            f"put_rows_back: return_ids, count, the tables and values_src must be on src's device {src.device}, got "
            f"{[str(t.device) for t in on_src_device]}")
    VALIDATED.add(key)


def check_return_table(op, return_table, peer_table) -> None:
    """A dispatch PUT's return table: the owners' [C] int64 arrays, one address per peer like peer_table."""
    if return_table is None or (return_table.shape == peer_table.shape and return_table.dtype == torch.int64
                                and return_table.device == peer_table.device):
        return  # every PUT of a put-return step passes here: no message built unless it is raised
    raise ValueError(f"{op}: return_table must be an int64 [{peer_table.numel()}] table like peer_table on "
                     f"{peer_table.device}, got {return_table.dtype} {tuple(return_table.shape)} on "
                     f"{return_table.device}")


def check_runnable(op, rows_like):
    require(rows_like.is_cuda or os.environ.get("TRITON_INTERPRET") == "1",
             f"{op}: tensors are on {rows_like.device}; the Triton kernels need CUDA tensors (on CPU use "
             "megatron_ext.kernels.row_transfer_ref, or set TRITON_INTERPRET=1 before importing triton)")


def _check_values_in_place(op, source_values, source_rows, values) -> None:
    """In place: per-route values come from the source rank's own [C] fp32 values, beside its rows."""
    require((source_values is None) == (values is None),
             f"{op}: per-route values need both the values out and the source's [C] fp32 values; got only one")
    if source_values is not None:
        rows = source_rows.shape[0]
        require(source_values.dtype == torch.float32 and source_values.shape == (rows,)
                 and source_values.is_contiguous() and source_values.device == source_rows.device,
                 f"{op}: in place, the source values must be a contiguous float32 [{rows}] on {source_rows.device}, "
                 f"got {source_values.dtype} {tuple(source_values.shape)} on {source_values.device}")


def _check_value_table(op, value_table, peer_table, values) -> None:
    """Per-route values need both the [T, K] values and the owners' int64 table of [C] fp32 arrays."""
    require((value_table is None) == (values is None),
             f"{op}: per-route values need both the values and value_table (the owners' [C] fp32 arrays); "
             f"got only one")
    if value_table is not None:
        require(value_table.dtype == torch.int64 and value_table.shape == peer_table.shape,
                 f"{op}: value_table must be int64 {tuple(peer_table.shape)} like peer_table, got "
                 f"{value_table.dtype} {tuple(value_table.shape)}", TypeError)
        require(value_table.device == peer_table.device,
                 f"{op}: value_table is on {value_table.device}, peer_table on {peer_table.device}")
