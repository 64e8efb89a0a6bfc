#!/usr/bin/env python3
"""Experts only, one GPU: Megatron's SequentialMLP against DeviceOffsetGroupedMLP (issue 3).

Same seeded routes, same permuted tokens and the same bf16 weights through
  (a) megatron.core SequentialMLP, fed a host `tokens_per_expert` as Megatron's alltoall
      dispatcher hands it over (a per-expert Python loop of small GEMMs),
  (b) DeviceOffsetGroupedMLP, fed the same rows with the counts as a device tensor,
  (c) DeviceOffsetGroupedMLP on a capacity buffer (capacity factor 1.25, NaN tail),
and a dense bf16 torch.mm of exactly the forward+backward FLOPs, measured in the same run, so
"% of dense" compares against this device's own GEMM rate. Reported per path: median
forward+backward and forward ms (CUDA events), host submission ms, model TFLOP/s (useful
rows only), peak memory, top kernels and host syncs (torch.profiler). (a) and (b) are
checked for bf16 parity (outputs and every gradient), (c) against (b) on the valid rows.

Variants (`--variants`, issue 21): `swiglu` (the fast path: gated SiLU, no biases), `gelu`
(Megatron's default non-gated GELU expert) and `swiglu_bias` (gated SiLU with fc1/fc2 biases, the
fc2 bias weighted by the router probability); each against SequentialMLP built from the same
config and weights.

Shapes: `reference` = 8192 tokens, 64 experts, top-8 (65536 rows), hidden 2048, ffn 1024;
`ep8_rank` = one EP8 rank of 128 experts (16 local) with 4 x 4096 tokens top-8, the routes
that land on this rank's experts (about 16384 rows), same hidden/ffn; `tiny` for a quick
check of the tool itself.

    python tools/bench_experts.py [--shapes reference,ep8_rank] [--iters 20] [--warmup 5] [--results-dir DIR]

Exits 1 (after writing the JSON) when a parity check fails, and 2 at once, writing nothing,
without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass

import torch

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.flops import moe_model_flops
from megatron_ext.bench.kernel_profile import profile_kernels
from megatron_ext.bench.measurement import cuda_time_ms, host_time_ms, median, peak_memory
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.testing.expert_variants import trainable_reference_config
from megatron_ext.testing.megatron_moe import moe_config
from megatron_ext.testing.single_rank import init_single_rank_megatron

PARITY_RTOL = 2e-2  # relative to the reference's max magnitude, bf16
CAPACITY_FACTOR = 1.25
ROUTE_SKEW = 0.1  # std of a per-expert logit bias: mild imbalance (max/mean load about 1.5)


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    topk: int
    experts: int
    local_experts: int  # this rank holds experts [0, local_experts)
    hidden: int
    ffn: int


SHAPES = {
    "reference": Shape("reference", tokens=8192, topk=8, experts=64, local_experts=64, hidden=2048, ffn=1024),
    "ep8_rank": Shape("ep8_rank", tokens=4 * 4096, topk=8, experts=128, local_experts=16, hidden=2048, ffn=1024),
    "tiny": Shape("tiny", tokens=256, topk=4, experts=8, local_experts=8, hidden=64, ffn=32),
}


@dataclass
class Routed:
    """Rows already permuted into local-expert order, as a dispatcher hands them to experts."""

    rows: torch.Tensor  # [R, H] bf16
    probs: torch.Tensor  # [R] fp32
    counts_host: torch.Tensor  # [L] int64, CPU (Megatron's alltoall dispatcher)
    counts_device: torch.Tensor  # [L] int64, on the device
    grad_out: torch.Tensor  # [R, H] bf16


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def route_tokens(shape: Shape, seed: int = 0) -> Routed:
    """Seeded top-k routes with a mild per-expert skew; keep the routes to local experts and
    sort them by expert (stable), gathering each route's token row."""
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(seed)
    skew = ROUTE_SKEW * torch.randn(shape.experts, device=dev, generator=gen)
    logits = torch.randn(shape.tokens, shape.experts, device=dev, generator=gen) + skew
    top_logits, top_idx = logits.topk(shape.topk, dim=-1)
    probs = torch.softmax(top_logits, dim=-1)
    local = top_idx < shape.local_experts
    token_idx = torch.nonzero(local)[:, 0]
    expert = top_idx[local]
    order = torch.argsort(expert, stable=True)
    tokens = torch.randn(shape.tokens, shape.hidden, device=dev, generator=gen).to(torch.bfloat16)
    counts = torch.bincount(expert, minlength=shape.local_experts)
    rows = tokens[token_idx[order]].contiguous()
    grad_out = torch.randn(rows.shape, device=dev, generator=gen).to(torch.bfloat16)
    return Routed(rows=rows, probs=probs[local][order].float().contiguous(), counts_host=counts.cpu(),
                  counts_device=counts, grad_out=grad_out)


VARIANTS = {
    "swiglu": {},
    "gelu": {"gated_linear_unit": False, "activation_func": torch.nn.functional.gelu},
    "swiglu_bias": {"add_bias_linear": True},
}


def random_weights(shape: Shape, gated: bool = True, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron layout, bf16: fc1 [L, 2F, H] (gate rows, then up rows; [L, F, H] non-gated), fc2 [L, H, F]."""
    gen = torch.Generator(device=device()).manual_seed(seed)
    L, H, F = shape.local_experts, shape.hidden, shape.ffn
    fc1 = torch.randn(L, (2 if gated else 1) * F, H, device=device(), generator=gen) * H ** -0.5
    fc2 = torch.randn(L, H, F, device=device(), generator=gen) * F ** -0.5
    return fc1.to(torch.bfloat16), fc2.to(torch.bfloat16)


def expert_config(shape: Shape, **variant):
    return moe_config(hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts, topk=shape.topk,
                      dtype=torch.bfloat16, use_cpu_initialization=not torch.cuda.is_available(),
                      perform_initialization=False, **variant)


@torch.no_grad()
def set_random_biases(sequential, grouped, shape: Shape, seed: int = 2) -> None:
    """The same random fc1/fc2 biases in both modules (Megatron initializes them to zero)."""
    if grouped.fc1_bias is None:
        return
    gen = torch.Generator(device=device()).manual_seed(seed)
    grouped.fc1_bias.copy_(torch.randn(grouped.fc1_bias.shape, device=device(), generator=gen) * 0.1)
    grouped.fc2_bias.copy_(torch.randn(grouped.fc2_bias.shape, device=device(), generator=gen) * 0.1)
    fc1_bias, fc2_bias = grouped.stacked_biases()  # [L, rows] views of the flat parameters
    for i, expert in enumerate(sequential.local_experts):
        expert.linear_fc1.bias.copy_(fc1_bias[i])
        expert.linear_fc2.bias.copy_(fc2_bias[i])


def build_sequential(shape: Shape, config, fc1: torch.Tensor, fc2: torch.Tensor):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import get_submodules

    layer_mlp = get_submodules(get_gpt_layer_local_submodules(num_experts=shape.experts).mlp)
    module = SequentialMLP(shape.local_experts, config, get_submodules(layer_mlp.experts),
                           pg_collection=get_default_pg_collection())
    with torch.no_grad():
        for i, expert in enumerate(module.local_experts):
            expert.linear_fc1.weight.copy_(fc1[i])
            expert.linear_fc2.weight.copy_(fc2[i])
    return module


def build_grouped(shape: Shape, config, fc1: torch.Tensor, fc2: torch.Tensor):
    from megatron_ext.moe.experts import DeviceOffsetGroupedMLP

    module = DeviceOffsetGroupedMLP(shape.local_experts, config)
    with torch.no_grad():
        module.fc1_weight.copy_(fc1)
        module.fc2_weight.copy_(fc2)
    return module


def weight_grads(module) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(module, "local_experts"):
        return (torch.stack([e.linear_fc1.weight.grad for e in module.local_experts]),
                torch.stack([e.linear_fc2.weight.grad for e in module.local_experts]))
    return module.fc1_weight.grad, module.fc2_weight.grad


@dataclass
class ExpertPath:
    """One way of running the experts: inputs (autograd leaves) and a forward closure."""

    name: str
    module: torch.nn.Module
    hidden: torch.Tensor
    probs: torch.Tensor
    counts: torch.Tensor
    grad_out: torch.Tensor

    def forward(self) -> torch.Tensor:
        return self.module(self.hidden, self.counts, self.probs)[0]

    def clear_grads(self) -> None:
        for leaf in (self.hidden, self.probs, *self.module.parameters()):
            leaf.grad = None

    def train_step(self) -> None:
        self.clear_grads()
        self.forward().backward(self.grad_out)

    def run_once(self) -> dict[str, torch.Tensor]:
        self.train_step()
        with torch.no_grad():
            out = self.forward()
        fc1_grad, fc2_grad = weight_grads(self.module)
        return {"out": out, "x_grad": self.hidden.grad, "prob_grad": self.probs.grad,
                "fc1_grad": fc1_grad, "fc2_grad": fc2_grad}


def make_path(name, module, rows, probs, counts, grad_out) -> ExpertPath:
    return ExpertPath(name, module, rows.detach().clone().requires_grad_(True),
                      probs.detach().clone().requires_grad_(True), counts, grad_out)


def capacity_path(module, routed: Routed) -> tuple[ExpertPath, int]:
    """Rows in the prefix of a cf=1.25 capacity buffer whose tail (inputs, probs and output
    gradient) is NaN: a kernel that touched the tail would poison the valid rows."""
    valid = routed.rows.shape[0]
    capacity = math.ceil(CAPACITY_FACTOR * valid)

    def padded(t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((capacity, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
        buf[:valid] = t
        return buf

    return make_path("grouped_capacity", module, padded(routed.rows), padded(routed.probs),
                     routed.counts_device, padded(routed.grad_out)), valid


def relative_errors(got: dict, want: dict, valid: int | None = None) -> dict[str, float]:
    """max |got - want| / max |want| per tensor; `valid` restricts row-indexed ones to a prefix."""
    errors = {}
    for key, ref in want.items():
        actual = got[key]
        if valid is not None and key in ("out", "x_grad", "prob_grad"):
            actual = actual[:valid]
        actual, ref = actual.detach().float(), ref.detach().float()
        errors[key] = float((actual - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    return errors


def dense_gemm(rows: int, hidden: int, ffn: int, warmup: int, iters: int) -> dict:
    """One bf16 torch.mm [rows, H] @ [H, 9F]: 2*rows*H*9F = the experts' forward+backward FLOPs."""
    dev = device()
    a = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
    b = torch.randn(hidden, 9 * ffn, device=dev).to(torch.bfloat16)
    c = torch.empty(rows, 9 * ffn, device=dev, dtype=torch.bfloat16)
    ms = median(cuda_time_ms(lambda: torch.mm(a, b, out=c), warmup, iters))
    flops = 2 * rows * hidden * 9 * ffn
    return {"shape": [rows, hidden, 9 * ffn], "ms": ms, "tflops": flops / ms / 1e9}


def measure(path: ExpertPath, flops: int, warmup: int, iters: int) -> dict:
    """Medians of fwd+bwd and training-mode forward (autograd on) device time, host submission
    time, peak memory of one step and a 3-step profile."""
    step_ms = median(cuda_time_ms(path.train_step, warmup, iters))
    forward_ms = median(cuda_time_ms(path.forward, warmup, iters))
    host_ms = median(host_time_ms(path.train_step, warmup=1, iters=iters))
    path.clear_grads()  # the baseline is inputs and weights, without last step's gradients
    memory = peak_memory(path.train_step)
    profile = profile_kernels(path.train_step, iters=3, top=8)
    return {"fwd_bwd_ms": step_ms, "fwd_ms": forward_ms, "host_submit_ms": host_ms,
            "tflops": flops / step_ms / 1e9, "memory": memory, "profile": profile}


def run_shape(shape: Shape, warmup: int, iters: int, variant: str = "swiglu") -> tuple[dict, list[str]]:
    torch.manual_seed(0)
    routed = route_tokens(shape)
    rows = routed.rows.shape[0]
    counts = routed.counts_host
    config = expert_config(shape, **VARIANTS[variant])
    gated = config.gated_linear_unit
    flops = moe_model_flops(rows, 1, shape.hidden, shape.ffn, gated=gated)
    fc1, fc2 = random_weights(shape, gated)
    # Megatron 0.19.2's SequentialMLP cannot backpropagate through fc2's bias at EP=1 (an in-place
    # add on a view): trainable_reference_config sidesteps it without changing the experts.
    sequential_module = build_sequential(shape, trainable_reference_config(config), fc1, fc2)
    grouped_module = build_grouped(shape, config, fc1, fc2)
    set_random_biases(sequential_module, grouped_module, shape)
    sequential = make_path("sequential", sequential_module, routed.rows, routed.probs, routed.counts_host,
                           routed.grad_out)
    grouped = make_path("grouped", grouped_module, routed.rows, routed.probs, routed.counts_device, routed.grad_out)
    capacity, valid = capacity_path(grouped_module, routed)
    del fc1, fc2

    failures = []
    want = sequential.run_once()
    got = grouped.run_once()
    parity = relative_errors(got, want)
    got_capacity = capacity.run_once()
    capacity_vs_grouped = relative_errors(got_capacity, got, valid=valid)
    del want, got, got_capacity
    for label, errors in (("grouped vs sequential", parity), ("capacity vs grouped", capacity_vs_grouped)):
        for key, err in errors.items():
            if not err <= PARITY_RTOL:  # also catches NaN
                failures.append(f"{shape.name}/{variant}: {label} {key} relative error {err:.3e} > {PARITY_RTOL}")

    paths = {}
    for path in (sequential, grouped, capacity):
        paths[path.name] = measure(path, flops, warmup, iters)
        paths[path.name]["rows_in_buffer"] = path.hidden.shape[0]
    dense = dense_gemm(rows, shape.hidden, shape.ffn, warmup, iters)
    for result in paths.values():
        result["pct_of_dense"] = 100.0 * result["tflops"] / dense["tflops"]
    result = {
        "variant": variant, "shape": asdict(shape), "routed_rows": rows, "capacity_rows": capacity.hidden.shape[0],
        "load_max_over_mean": float(counts.max() / counts.float().mean()), "empty_experts": int((counts == 0).sum()),
        "model_flops_fwd_bwd": flops, "dense_gemm": dense, "paths": paths,
        "speedup_grouped_over_sequential": paths["sequential"]["fwd_bwd_ms"] / paths["grouped"]["fwd_bwd_ms"],
        "speedup_grouped_over_sequential_fwd": paths["sequential"]["fwd_ms"] / paths["grouped"]["fwd_ms"],
        "parity_grouped_vs_sequential": parity, "parity_capacity_vs_grouped": capacity_vs_grouped,
    }
    return result, failures


def mib(memory: dict | None, key: str) -> str:
    return "-" if memory is None else f"{memory[key] / 2**20:.0f}"


def print_table(results: dict) -> None:
    header = (f"{'shape':<10} {'path':<17} {'rows':>7} {'fwd+bwd ms':>10} {'fwd ms':>7} {'host ms':>8} "
              f"{'TFLOP/s':>8} {'% dense':>7} {'peak+ MiB':>9} {'syncs':>5}")
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        for path_name, p in res["paths"].items():
            print(f"{name:<10} {path_name:<17} {p['rows_in_buffer']:>7} {p['fwd_bwd_ms']:>10.3f} {p['fwd_ms']:>7.3f} "
                  f"{p['host_submit_ms']:>8.3f} {p['tflops']:>8.1f} {p['pct_of_dense']:>7.1f} "
                  f"{mib(p['memory'], 'peak_above_baseline_bytes'):>9} {p['profile']['host_syncs_per_iter']:>5.1f}")
        d = res["dense_gemm"]
        print(f"{name:<10} {'dense torch.mm':<17} {'':>7} {d['ms']:>10.3f} {'':>7} {'':>8} "
              f"{d['tflops']:>8.1f} {100.0:>7.1f}")
        print(f"{name:<10} speedup grouped/sequential: fwd+bwd {res['speedup_grouped_over_sequential']:.2f}x, "
              f"fwd {res['speedup_grouped_over_sequential_fwd']:.2f}x; routed rows {res['routed_rows']}, "
              f"load max/mean {res['load_max_over_mean']:.2f}")
        print(f"{name:<10} parity grouped vs sequential (rel. to max): "
              + ", ".join(f"{k} {v:.2e}" for k, v in res["parity_grouped_vs_sequential"].items()))
        print(f"{name:<10} parity capacity vs grouped (valid rows):   "
              + ", ".join(f"{k} {v:.2e}" for k, v in res["parity_capacity_vs_grouped"].items()))
    print()
    for name, res in results.items():
        for path_name, p in res["paths"].items():
            print(f"{name} / {path_name}: kernels {p['profile']['kernel_ms_per_iter']:.3f} ms/iter, top:")
            for k in p["profile"]["top_kernels"]:
                print(f"    {k['ms_per_iter']:8.3f} ms {100 * k['share']:5.1f}% x{k['calls_per_iter']:<5.0f} "
                      f"{k['name'][:110]}")
            print("  top host ops (self CPU ms/iter): " + ", ".join(
                f"{op['name']} {op['self_cpu_ms_per_iter']:.3f}" for op in p["profile"]["top_host_ops"][:6]))
            if p["profile"]["host_sync_sites"]:
                print(f"  host syncs in 3 iterations: {p['profile']['host_sync_sites']}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="reference,ep8_rank",
                        help=f"comma-separated, from {sorted(SHAPES)} (default: reference,ep8_rank)")
    parser.add_argument("--variants", default="swiglu",
                        help=f"comma-separated expert variants, from {sorted(VARIANTS)} (default: swiglu)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before each measurement")
    add_results_dir_arg(parser)
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("tools/bench_experts.py")
    init_single_rank_megatron()
    results, failures = {}, []
    for name in args.shapes.split(","):
        for variant in args.variants.split(","):
            key = name if variant == "swiglu" else f"{name}/{variant}"
            results[key], shape_failures = run_shape(SHAPES[name], args.warmup, args.iters, variant)
            failures += shape_failures
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(results)
    path = write_result("experts", {"args": vars(args), "parity_rtol": PARITY_RTOL, "shapes": results,
                                    "failures": failures}, args.results_dir)
    print(f"\nwrote {path}")
    for failure in failures:
        print(f"PARITY FAILURE: {failure}", file=sys.stderr)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
