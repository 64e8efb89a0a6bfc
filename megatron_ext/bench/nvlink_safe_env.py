"""NVLink multicast off, for this process and every process it starts (set on import).

Multicast must stay off on the lent multi-GPU hosts (BENCHMARKS.md, "Multi-GPU checks"). NCCL and torch
symmetric memory read these variables when they initialize, so the multi-GPU tools import this
module before anything initializes them; ep_distributed.init_distributed sets them again.
"""

from __future__ import annotations

import os

NVLINK_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NVLINK_SAFE_ENV)
