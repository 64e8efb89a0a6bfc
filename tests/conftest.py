"""Test setup: CPU shims for Megatron-Core when there is no GPU (before any test imports it)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext._cpu import apply_cpu_shims  # noqa: E402

apply_cpu_shims()
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; runs on the H200 (tests/gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
