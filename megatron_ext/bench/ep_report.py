"""The EP layer benchmark's summary on rank 0: one row per path from every rank's measurements, the
rowwise/Megatron dispatch+combine ratios, the same-routes check, and the printed table.
"""

from __future__ import annotations

from megatron_ext.bench.ep_distributed import median
from megatron_ext.bench.ep_paths import Shape
from megatron_ext.bench.flops import credited_flops

TARGET_SHORTER = 0.35  # issue 11: rowwise symm dispatch+combine at least 35% shorter than Megatron's


PHASES = ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")


def summarize(per_rank: list[dict], flops: int, routes: int | None = None) -> dict:
    """One path's row from every rank's measurements.

    `flops`: one rank's work with all of its `routes` (tokens x top-k) kept; a path that dropped
    routes is credited only the kept ones (`credited_flops`), so its TFLOP/s is not inflated by
    work it did not do. The phase columns are medians over ranks and iterations, and
    `dispatch_combine_ms` is their sum, so the columns add up to the total the ratios use (the
    median of the per-iteration sums is kept beside it as `dispatch_combine_median_of_sums_ms`)."""
    first = per_rank[0]
    for key in ("unavailable", "error"):
        reasons = {r.get(key) for r in per_rank if r.get(key)}
        if reasons:
            return {"path": first["path"], key: " | ".join(sorted(reasons))}
    row = {"path": first["path"], "ranks": len(per_rank)}
    layer_ms = [ms for r in per_rank for ms in r["layer_ms"]]
    row["layer_fwd_bwd_ms"] = median(layer_ms)
    row["layer_fwd_bwd_ms_slowest_rank"] = max(median(r["layer_ms"]) for r in per_rank)
    credited = flops
    if "dropped_routes_per_step" in first:
        dropped_per_rank = sum(r["dropped_routes_per_step"] for r in per_rank) / len(per_rank)
        if routes is not None:
            credited = credited_flops(flops, routes, dropped_per_rank)
    row["credited_flops_per_rank_step"] = credited
    row["tflops_per_gpu"] = credited / row["layer_fwd_bwd_ms"] / 1e9
    if "phases" in first:
        keys = first["phases"][0].keys()
        row["phases_ms"] = {k: median(it[k] for r in per_rank for it in r["phases"]) for k in keys}
        if all(k in row["phases_ms"] for k in PHASES):
            row["dispatch_combine_ms"] = sum(row["phases_ms"][k] for k in PHASES)
        else:
            row["dispatch_combine_ms"] = row["phases_ms"]["dispatch_combine"]
        if "dispatch_combine" in row["phases_ms"]:
            row["dispatch_combine_median_of_sums_ms"] = row["phases_ms"]["dispatch_combine"]
        if "layer" in row["phases_ms"]:  # the phase-timed iterations' whole step: the timers' own cost shows here
            row["layer_fwd_bwd_ms_phase_timed"] = row["phases_ms"]["layer"]
    memories = [r["memory"] for r in per_rank if r.get("memory")]
    if memories:
        row["peak_above_baseline_bytes_max_rank"] = max(m["peak_above_baseline_bytes"] for m in memories)
        row["peak_bytes_max_rank"] = max(m["peak_bytes"] for m in memories)
        held = [m["held_for_backward_bytes"] for m in memories if "held_for_backward_bytes" in m]
        row["held_for_backward_bytes_max_rank"] = max(held) if held else None
    calls = [r["blocking_cuda_calls"] for r in per_rank if r.get("blocking_cuda_calls") is not None]
    row["blocking_cuda_calls_max_rank"] = max(calls) if calls else None
    diffs = [r["out_rel_diff_vs_first_path"] for r in per_rank if r.get("out_rel_diff_vs_first_path") is not None]
    row["out_rel_diff_vs_first_path_max_rank"] = max(diffs) if diffs else None
    if "dropped_routes_per_step" in first:
        row["dropped_routes_per_step_all_ranks"] = sum(r["dropped_routes_per_step"] for r in per_rank)
        row["mean_buffer_fill"] = median(r["mean_buffer_fill"] for r in per_rank)
        row["capacity_rows"] = first["capacity_rows"]
        for key in ("dispatch_row_bytes", "dispatch_buffer_bytes"):
            if key in first:
                row[key] = first[key]
    if "overflow" in first:  # the bounded path's check, the same on every rank (the count is global)
        row["overflow"] = first["overflow"]
    row["routing_digests"] = [r["routing_digest"] for r in per_rank]
    return row


MEGATRON_PATHS = ("megatron_alltoall", "megatron_alltoall_gg", "megatron_flex_deepep_gg")


def dispatch_combine_ratios(rows: list[dict]) -> dict:
    """rowwise_symm (and its MXFP8 variant) dispatch+combine over each Megatron path's."""
    timed = {r["path"]: r["dispatch_combine_ms"] for r in rows if r.get("dispatch_combine_ms")}
    ratios = {}
    for rowwise in ("rowwise_symm", "rowwise_symm_mxfp8", "rowwise_torch"):
        for megatron in MEGATRON_PATHS:
            if rowwise in timed and megatron in timed:
                ratio = timed[rowwise] / timed[megatron]
                ratios[f"{rowwise}/{megatron}"] = {"ratio": ratio, "shorter_by": 1 - ratio}
    return ratios


def layer_ratios(rows: list[dict]) -> dict:
    """rowwise_symm's layer fwd+bwd time over each Megatron path's with the same grouped experts."""
    timed = {r["path"]: r["layer_fwd_bwd_ms"] for r in rows if r.get("layer_fwd_bwd_ms")}
    return {f"rowwise_symm/{megatron}": timed["rowwise_symm"] / timed[megatron]
            for megatron in ("megatron_alltoall_gg", "megatron_flex_deepep_gg")
            if "rowwise_symm" in timed and megatron in timed}


def mxfp8_vs_bf16(rows: list[dict]) -> dict:
    """rowwise_symm_mxfp8 over rowwise_symm: dispatch-buffer bytes and dispatch forward time."""
    by_path = {r["path"]: r for r in rows if "unavailable" not in r and "error" not in r}
    mx, bf16 = by_path.get("rowwise_symm_mxfp8"), by_path.get("rowwise_symm")
    if not mx or not bf16:
        return {}
    found = {}
    if mx.get("dispatch_buffer_bytes") and bf16.get("dispatch_buffer_bytes"):
        found["buffer_bytes_ratio"] = mx["dispatch_buffer_bytes"] / bf16["dispatch_buffer_bytes"]
    mx_phases, bf16_phases = mx.get("phases_ms") or {}, bf16.get("phases_ms") or {}
    if mx_phases.get("dispatch_fwd") and bf16_phases.get("dispatch_fwd"):
        found["dispatch_fwd_ratio"] = mx_phases["dispatch_fwd"] / bf16_phases["dispatch_fwd"]
    return found


def same_routes(rows: list[dict]) -> bool | None:
    digests = [tuple(r["routing_digests"]) for r in rows if "routing_digests" in r]
    return len(set(digests)) == 1 if digests else None


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(rows: list[dict], ratios: dict, shape: Shape, world: int, routes_equal) -> None:
    print(f"\nEP{world} MoE layer, {world} ranks: {shape.sequences} x {shape.seq_length} = {shape.tokens} tokens "
          f"per rank, {shape.experts} experts, top-{shape.topk}, hidden {shape.hidden}, expert ffn {shape.ffn} "
          f"(SwiGLU); medians over ranks and iterations; same routes on every path: {routes_equal}")
    print("disp+comb ms: the sum of the four phase medians beside it (phases timed in separate iterations from "
          "fwd+bwd ms); dropped: routes dropped per step, all ranks (* marks rows with drops); TFLOP/s "
          "credits only the kept routes")
    header = (f"{'path':22s} {'fwd+bwd ms':>10s} {'disp+comb ms':>12s} {'disp f/b ms':>13s} {'comb f/b ms':>13s} "
              f"{'TFLOP/s':>8s} {'peak+ MiB':>9s} {'held MiB':>8s} {'syncs':>5s} {'dropped':>8s} {'out diff':>8s} "
              f"{'row B':>6s}")
    print(header)
    for r in rows:
        if "unavailable" in r or "error" in r:
            print(f"{r['path']:22s} {'NOT AVAILABLE' if 'unavailable' in r else 'ERROR'}: "
                  f"{r.get('unavailable') or r.get('error')}")
            continue
        phases = r.get("phases_ms", {})
        disp = (f"{phases['dispatch_fwd']:.2f}/{phases['dispatch_bwd']:.2f}" if phases else "-")
        comb = (f"{phases['combine_fwd']:.2f}/{phases['combine_bwd']:.2f}" if phases else "-")
        peak = r.get("peak_above_baseline_bytes_max_rank")
        held = r.get("held_for_backward_bytes_max_rank")
        dropped = r.get("dropped_routes_per_step_all_ranks")
        print(f"{r['path']:22s} {r['layer_fwd_bwd_ms']:10.2f} {_fmt(r.get('dispatch_combine_ms'), '12.2f'):>12s} "
              f"{disp:>13s} {comb:>13s} {r['tflops_per_gpu']:8.1f} {_fmt(peak and peak / 2**20, '9.0f'):>9s} "
              f"{_fmt(held and held / 2**20, '8.0f'):>8s} "
              f"{_fmt(r.get('blocking_cuda_calls_max_rank'), 'd'):>5s} "
              f"{_fmt(dropped, '.0f'):>8s}{'*' if dropped else ' '}"
              f"{_fmt(r.get('out_rel_diff_vs_first_path_max_rank'), '.1e'):>8s} "
              f"{_fmt(r.get('dispatch_row_bytes'), 'd'):>6s}")
    for r in rows:
        if r.get("overflow") not in (None, "none"):
            print(f"{r['path']}: overflowed its bound: {r['overflow']}")
    for name, value in ratios.items():
        change = "shorter" if value["shorter_by"] >= 0 else "longer"
        print(f"dispatch+combine {name}: ratio {value['ratio']:.3f} ({100 * abs(value['shorter_by']):.1f}% {change})")
    for name, value in layer_ratios(rows).items():
        print(f"layer fwd+bwd {name}: {value:.3f}x")
    for name, value in mxfp8_vs_bf16(rows).items():
        print(f"rowwise_symm_mxfp8 / rowwise_symm {name}: {value:.3f}")
    target = ratios.get("rowwise_symm/megatron_alltoall")
    if target:
        met = "MET" if target["shorter_by"] >= TARGET_SHORTER else "NOT MET"
        print(f"issue 11 target (rowwise symm dispatch+combine >= {100 * TARGET_SHORTER:.0f}% shorter than Megatron "
              f"alltoall): {met}")
    else:
        print("issue 11 target: not evaluated (rowwise_symm or megatron_alltoall has no dispatch+combine time)")
