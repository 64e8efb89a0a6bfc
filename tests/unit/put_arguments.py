"""Arguments for the PUT kernels' argument-check tests (BF16 `put_rows`, fused `put_rows_mxfp8`):
valid CPU defaults with one common defect applied, so each test lists only its own cases."""

from __future__ import annotations

import os

import pytest
import torch

# (case, error type, message) that both PUT kernels must raise
COMMON_PUT_ERRORS = [
    ("rank_int64", TypeError, "dest_rank must be int32"),
    ("row_shape", ValueError, "dest_row must be"),
    ("table_int32", TypeError, "peer_table must be int64"),
    ("src_noncontig", ValueError, "rows is not contiguous"),
    ("cpu", ValueError, "need CUDA tensors"),
]


def put_arguments(case: str, hidden: int, tokens: int = 3, topk: int = 2):
    """(src [tokens, hidden], dest_rank, dest_row, peer_table) with `case`'s defect, if common.
    Skips the calling test for "cpu" under TRITON_INTERPRET=1, where CPU tensors are legal."""
    src = torch.zeros(tokens, hidden)
    dest_rank = torch.zeros(tokens, topk, dtype=torch.int32)
    dest_row = torch.zeros(tokens, topk, dtype=torch.int32)
    table = torch.zeros(2, dtype=torch.int64)
    if case == "rank_int64":
        dest_rank = dest_rank.long()
    elif case == "row_shape":
        dest_row = torch.zeros(tokens + 1, topk, dtype=torch.int32)
    elif case == "table_int32":
        table = table.int()
    elif case == "src_noncontig":
        src = torch.zeros(hidden, tokens).t()
    elif case == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter accepts CPU tensors")
    return src, dest_rank, dest_row, table
