"""Host-sync audit for a MoE layer configuration: run it on your shapes before you train.

For each requested layer kind it builds the layer on this GPU (EP=1), runs a warm-up step, and
reports, strongest evidence first:
  capture   does forward+backward capture in a CUDA graph and replay like eager?
  profiler  blocking CUDA runtime calls in one eager step (cuda*Synchronize, blocking D2H)
  python    every Python call site that reads a device value on the host, with its stack

    python tools/host_sync_audit.py --layers rowwise_symm,megatron_alltoall \\
        --tokens 4096 --experts 64 --topk 8 --hidden 2048 --ffn 1024 [--stacks 3]

On a machine without CUDA it runs the Python audit only, on CPU tensors (gloo, one rank), and
leaves out rowwise_symm (the symm transport needs a GPU), printing one line that says so.
"""

from __future__ import annotations

import argparse

from megatron_ext.quiet import quiet_known_warnings

quiet_known_warnings()  # before Megatron is imported
import torch  # noqa: E402

from megatron_ext.bench.cli_types import non_negative_int  # noqa: E402
from megatron_ext.bench.layer_shape import add_layer_shape_args, check_layer_shape  # noqa: E402
from megatron_ext.testing.megatron_moe import megatron_moe_layer, moe_config  # noqa: E402
from megatron_ext.testing.single_rank import init_single_rank_megatron  # noqa: E402

LAYERS = ("rowwise_symm", "rowwise_torch", "megatron_alltoall", "megatron_allgather")
GPU_ONLY_LAYERS = ("rowwise_symm",)


def build_layer(kind: str, args, dtype, device):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder

    config = moe_config(hidden=args.hidden, ffn=args.ffn, experts=args.experts, topk=args.topk, dtype=dtype,
                        use_cpu_initialization=device.type == "cpu",
                        dispatcher="allgather" if kind == "megatron_allgather" else "alltoall")
    if kind.startswith("megatron"):
        return megatron_moe_layer(config).to(device)
    transport = "symm" if kind == "rowwise_symm" else "torch"
    builder = moe_builder(MoEExtConfig(transport=transport, capacity_factor=args.capacity_factor))
    return builder(config=config).to(device)


def without_gpu_only_layers(kinds: list[str]) -> list[str]:
    """The layer kinds a CPU audit can run: rowwise_symm needs a GPU (symmetric memory, Triton) and
    is left out, with one printed line saying so; an empty list becomes rowwise_torch, the same
    rowwise layer on the torch transport."""
    kept = [kind for kind in kinds if kind not in GPU_ONLY_LAYERS]
    dropped = [kind for kind in kinds if kind in GPU_ONLY_LAYERS]
    if dropped:
        if not kept:
            hint = "; auditing rowwise_torch (the same rowwise layer, torch transport) instead"
        elif "rowwise_torch" not in kept:
            hint = "; --layers rowwise_torch audits the same rowwise layer on CPU"
        else:
            hint = ""
        print(f"no CUDA GPU visible: {', '.join(dropped)} left out (the symm transport needs a GPU){hint}", flush=True)
    return kept or ["rowwise_torch"]


def audit(kind: str, args) -> dict:
    from megatron_ext.sync_audit import count_host_syncs

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    layer = build_layer(kind, args, dtype, device)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        out, _ = layer(x)
        out.backward(grad)
        return out

    step()  # warm-up: allocations, compilation
    report = {"layer": kind}
    with count_host_syncs(only_device="cuda" if on_gpu else None) as python_audit:
        step()
    report["python_sync_sites"] = python_audit.count
    report["python_stacks"] = [stack for _, stack in python_audit.calls[:args.stacks]]
    if on_gpu:
        from megatron_ext.host_sync import capture_replay, profiled_sync_calls

        report["profiler_blocking_calls"] = profiled_sync_calls(step)
        try:
            capture_replay(step)[0].replay()
            torch.cuda.synchronize()
            report["cuda_graph_capture"] = "ok"
        except Exception as error:  # noqa: BLE001 - the failure is the finding
            report["cuda_graph_capture"] = f"fails: {type(error).__name__}: {str(error)[:160]}"
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="rowwise_symm,megatron_alltoall")
    add_layer_shape_args(parser, tokens=4096, experts=16, topk=4, hidden=1024, ffn=512)
    parser.add_argument("--stacks", type=non_negative_int, default=2, help="Python stacks to print per layer")
    args = parser.parse_args()
    check_layer_shape(parser, args)
    kinds = args.layers.split(",")
    unknown = sorted(set(kinds) - set(LAYERS))
    if unknown:
        parser.error(f"unknown layer kind(s) {unknown}; choose from {LAYERS}")
    if not torch.cuda.is_available():
        kinds = without_gpu_only_layers(kinds)
    init_single_rank_megatron()
    for kind in kinds:
        report = audit(kind, args)
        print(f"== {kind}: python sync sites {report['python_sync_sites']}, "
              f"profiler blocking calls {report.get('profiler_blocking_calls', 'n/a (no GPU)')}, "
              f"CUDA graph capture {report.get('cuda_graph_capture', 'n/a (no GPU)')}")
        for stack in report["python_stacks"]:
            print("   " + stack.replace("\n", "\n   "))


if __name__ == "__main__":
    main()
