"""Why an op costs several times more inside the eager layer step than in a loop (issue 17, item 2).

One op, the fused router's gating GEMM (bf16 tokens [T, H] x bf16 weight [E, H]^T -> fp32 logits,
cuBLAS), has its host time taken right after each of these preludes, with the GPU idle at its
start (a synchronize follows every prelude but gpu_busy's):

  warm         nothing: the op ran just before (what a loop measures)
  gpu_busy     a 2 ms sleep kernel queued ahead of it (the GPU holds work, the host does not)
  layer_step   one forward+backward of the rowwise layer (bench/reference_layer.py)
  step_lib     the layer step, then the same cuBLAS call on another shape (its code is warm again)
  cpu_code     ~20 distinct CPU torch ops on small tensors: other code through the dispatcher, no GPU
  cpu_data     64 MiB of host memory written, every cache line: L2 and most of L3 evicted (code
               and data alike: those caches hold both), no new code run

Printed per prelude: median host us of the op's first call after it and of its second call.
Then the layer step's own host time three ways: the GPU idle at its start (what
`bench_moe_layer` reports), a 20 ms kernel queued ahead (all of the step's launches wait in the
queue, as in device-bound training), and two steps back to back.

    python tools/bench_host_cold.py [--iters 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_ext.bench.cli_types import positive_int
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.measurement import median, synchronize
from megatron_ext.bench.reference_layer import EXPERTS, HIDDEN, rowwise_layer_step
from megatron_ext.bench.results import add_results_dir_arg, write_result

GPU_SLEEP_CYCLES = 2_000_000  # ~1-2 ms of torch.cuda._sleep on an H200
LONG_SLEEP_CYCLES = 40_000_000  # longer than a layer step's device time


def elapsed_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def cpu_code_prelude():
    """Run many distinct CPU kernels (code the step does not share with the GEMM's host path)."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    for op in (torch.add, torch.mul, torch.sub, torch.maximum, torch.minimum, torch.atan2, torch.hypot,
               torch.fmod, torch.remainder, torch.div):
        op(a, b)
    for op in (torch.cumsum, torch.softmax, torch.log_softmax, torch.argsort):
        op(a, 1)
    torch.sort(a, 1)
    torch.topk(a, 3)
    torch.linalg.qr(a)
    torch.fft.fft(a)


def cpu_data_prelude(blocks: list[bytearray]):
    """Write one byte of every 64-byte cache line of `blocks` (64 MiB of host memory)."""
    for block in blocks:
        block[::64] = bytes(len(block) // 64)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=8192)
    parser.add_argument("--iters", type=positive_int, default=30)
    add_results_dir_arg(parser)
    args = parser.parse_args()
    require_cuda("tools/bench_host_cold.py")
    step = rowwise_layer_step(args.tokens)
    tokens = torch.randn(args.tokens, HIDDEN, device="cuda").bfloat16()
    weight = torch.randn(EXPERTS, HIDDEN, device="cuda").bfloat16()
    other_weight = torch.randn(EXPERTS // 2, HIDDEN, device="cuda").bfloat16()
    host_blocks = [bytearray(4 << 20) for _ in range(16)]

    def gating_gemm():
        return torch.mm(tokens, weight.t(), out_dtype=torch.float32)

    preludes = {
        "warm": lambda: None,
        "gpu_busy": lambda: torch.cuda._sleep(GPU_SLEEP_CYCLES),
        "layer_step": step,
        "step_lib": lambda: (step(), synchronize(), torch.mm(tokens, other_weight.t(), out_dtype=torch.float32)),
        "cpu_code": cpu_code_prelude,
        "cpu_data": lambda: cpu_data_prelude(host_blocks),
    }
    op_us = {}
    for name, prelude in preludes.items():
        first, second = [], []
        for _ in range(args.iters):
            gating_gemm()
            synchronize()
            prelude()
            if name != "gpu_busy":
                synchronize()
            first.append(elapsed_us(gating_gemm))
            second.append(elapsed_us(gating_gemm))
        synchronize()
        op_us[name] = {"first_us": median(first), "second_us": median(second)}
        print(f"gating GEMM after {name:10s}: first call {median(first):7.1f} us, second {median(second):7.1f} us",
              flush=True)

    def step_us(before, steps=1):
        times = []
        for _ in range(args.iters):
            synchronize()
            before()
            times.append(elapsed_us(lambda: [step() for _ in range(steps)]) / steps)
        synchronize()
        return median(times)

    step_host = {"gpu_idle": step_us(lambda: None),
                 "behind_long_kernel": step_us(lambda: torch.cuda._sleep(LONG_SLEEP_CYCLES)),
                 "back_to_back_per_step": step_us(lambda: None, steps=2)}
    for name, us in step_host.items():
        print(f"layer step host, {name:22s}: {us / 1e3:.3f} ms", flush=True)
    path = write_result("host_cold", {"args": vars(args), "gating_gemm_us": op_us, "step_host_us": step_host},
                        args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
