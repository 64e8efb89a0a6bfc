"""Figures for BENCHMARKS.md from the benchmark result JSON in bench/results/ (issue 19).

    python tools/plot_benchmarks.py                      # bench/results/ -> docs/figures/
    python tools/plot_benchmarks.py --results DIR --out DIR

Needs matplotlib (`pip install 'megatron-ext[bench]'`); exits 2 with one line without it.
Each figure comes from the newest result of its kind (by the time stamp in the file name that
megatron_ext.bench.results.write_result gives it, `<name>_<YYYYmmdd-HHMMSS>[-N].json`), or from the file
named with the figure's option:

  layer_time.png     fwd+bwd ms per path, one GPU (tools/bench_moe_layer.py, moe_layer_*.json)
  ep_layer_time.png  layer fwd+bwd ms per path at EP=world size, with the dispatch+combine part
                     (tools/bench_ep.py, ep_layer_*.json)
  transport_gbps.png row-transfer GB/s per GPU against tokens per rank, with NVLink's per-direction
                     rate (tools/bench_transport.py, transport_*.json)
  mxfp8_loss.png     BF16 and MXFP8 loss per step and their difference
                     (tools/mxfp8_loss_curve.py, mxfp8_loss_*.json)

A figure whose input is missing or unreadable is skipped with one line saying so. The tool
prints every PNG it wrote and the JSON it came from. Exit status: 0 when at least one figure
was written, 1 when none was, 2 without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
FIGURES_DIR = REPO_ROOT / "docs" / "figures"
NVLINK_GBPS_PER_DIRECTION = 450.0  # H100/H200 NVLink 4, as in tools/bench_transport.py
DPI = 100
INSTALL_HINT = "pip install 'megatron-ext[bench]'"

PATH_LABELS = {
    "megatron_alltoall": "Megatron alltoall + SequentialMLP",
    "megatron_alltoall_gg": "Megatron alltoall + DeviceOffsetGroupedMLP",
    "rowwise_torch": "rowwise, torch transport",
    "rowwise_symm": "rowwise, symm, BF16, eager",
    "rowwise_symm_graph": "rowwise, symm, BF16, CUDA graph",
    "rowwise_symm_mxfp8": "rowwise, symm, MXFP8, eager",
    "rowwise_symm_mxfp8_graph": "rowwise, symm, MXFP8, CUDA graph",
}


class Skip(Exception):
    """A figure that cannot be made from its input; the message says why."""


# ----------------------------------------------------------------------------- inputs
def newest_result(results_dir: Path, name: str) -> Path | None:
    """The newest `<name>_<YYYYmmdd-HHMMSS>[-N].json` in results_dir that ran on a GPU, or None
    (moe_layer_profile_* is not a moe_layer result). CPU runs (`bench_ep --device cpu --tiny`, which
    write here too) are left out: the figures show GPU results; pass a file to plot one anyway."""
    pattern = re.compile(rf"^{re.escape(name)}_(\d{{8}}-\d{{6}})(?:-(\d+))?\.json$")
    found = []
    if results_dir.is_dir():
        for path in results_dir.iterdir():
            match = pattern.match(path.name)
            if match:
                found.append(((match.group(1), int(match.group(2) or 0)), path))
    for _, path in sorted(found, reverse=True):
        if _ran_on_gpu(path):
            return path
    return None


def _ran_on_gpu(path: Path) -> bool:
    """True unless the result's environment records no GPU (an unreadable file is left to load())."""
    try:
        env = json.loads(path.read_text()).get("env", {})
    except (OSError, ValueError, AttributeError):
        return True
    return not (isinstance(env, dict) and env.get("device_count") == 0)


def load(path: Path) -> dict:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise Skip(f"cannot read it: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("result"), dict):
        raise Skip("no 'result' object (not a megatron_ext.bench.results.write_result file)")
    return data


def device_of(data: dict) -> str:
    env = data.get("env") or {}
    device = env.get("device") or "unknown device"
    count = env.get("device_count")
    return f"{count} x {device}" if isinstance(count, int) and count > 1 else device


def label_of(path_id: str) -> str:
    return PATH_LABELS.get(path_id, path_id)


# ----------------------------------------------------------------------------- figures
def _save(fig, out_path: Path) -> None:
    fig.savefig(out_path, dpi=DPI, metadata={"Software": None})  # no version stamp: stable bytes


def _bar_chart(plt, labels: list[str], values: list[float], title: str, xlabel: str,
               inner: list[float | None] | None = None, inner_label: str = "", notes: list[str] = ()):
    with_inner = bool(inner) and any(v is not None for v in inner)
    height = 1.4 + 0.45 * len(labels) + 0.15 * len(notes) + 0.3 * with_inner
    fig, ax = plt.subplots(figsize=(8.5, height), layout="constrained")
    y = list(range(len(labels)))[::-1]  # first path at the top
    bars = ax.barh(y, values, color="#4c72b0", height=0.6, label="layer fwd+bwd")
    if with_inner:
        ax.barh(y, [v or 0.0 for v in inner], color="#dd8452", height=0.3, label=inner_label)
        fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("\n".join([xlabel, *notes]), fontsize=9)  # notes under the axis, inside the layout
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _shape_text(shape: dict, tokens=None, per_rank: bool = False) -> str:
    """'8192 tokens, 64 experts, top-8, hidden 2048, ffn 1024' from what the result has."""
    parts = [f"{tokens} tokens{' per rank' if per_rank else ''}"] if tokens is not None else []
    if "experts" in shape:
        parts.append(f"{shape['experts']} experts")
    if "topk" in shape:
        parts.append(f"top-{shape['topk']}")
    parts += [f"{key} {shape[key]}" for key in ("hidden", "ffn") if key in shape]
    return ", ".join(parts)


def plot_layer_time(plt, data: dict, out_path: Path) -> None:
    """moe_layer_*.json (tools/bench_moe_layer.py): result.rows[].{path, fwd_bwd_ms}."""
    result = data["result"]
    rows = [r for r in result.get("rows", []) if isinstance(r.get("fwd_bwd_ms"), (int, float))]
    if not rows:
        raise Skip("no row with fwd_bwd_ms")
    args = result.get("args", {})
    shape = _shape_text(args, tokens=args.get("tokens"))
    title = f"MoE layer forward+backward, one GPU (EP=1), {device_of(data)}\n{shape}"
    fig = _bar_chart(plt, [label_of(r["path"]) for r in rows], [r["fwd_bwd_ms"] for r in rows], title,
                     "fwd+bwd ms (median, CUDA events; lower is better)")
    _save(fig, out_path)
    plt.close(fig)


def plot_ep_layer_time(plt, data: dict, out_path: Path) -> None:
    """ep_layer_*.json (tools/bench_ep.py): result.rows[].{path, layer_fwd_bwd_ms, dispatch_combine_ms}
    or {path, unavailable|error}."""
    result = data["result"]
    rows = result.get("rows", [])
    timed = [r for r in rows if isinstance(r.get("layer_fwd_bwd_ms"), (int, float))]
    if not timed:
        raise Skip("no row with layer_fwd_bwd_ms")
    notes = [f"not shown: {r['path']}: {(r.get('unavailable') or r.get('error'))[:100]}"
             for r in rows if r.get("unavailable") or r.get("error")]
    shape = result.get("shape", {})
    ep = result.get("ep", result.get("world_size", "?"))
    desc = _shape_text(shape, tokens=result.get("tokens_per_rank"), per_rank=True)
    title = f"MoE layer forward+backward, EP={ep}, {device_of(data)}\n{desc}"
    fig = _bar_chart(plt, [label_of(r["path"]) for r in timed], [r["layer_fwd_bwd_ms"] for r in timed], title,
                     "ms (median over ranks and iterations; lower is better)",
                     inner=[r.get("dispatch_combine_ms") for r in timed],
                     inner_label="of which dispatch+combine (separate iterations)", notes=notes)
    _save(fig, out_path)
    plt.close(fig)


def plot_transport(plt, data: dict, out_path: Path) -> None:
    """transport_*.json (tools/bench_transport.py): result.rows[].{tokens, transport, transfer,
    gbps_per_gpu_median}, result.nvlink_gbps_per_direction."""
    result = data["result"]
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in result.get("rows", []):
        if isinstance(r.get("gbps_per_gpu_median"), (int, float)) and isinstance(r.get("tokens"), int):
            series.setdefault((r.get("transport", "?"), r.get("transfer", "?")), []).append(
                (r["tokens"], r["gbps_per_gpu_median"]))
    if not series:
        raise Skip("no row with tokens and gbps_per_gpu_median")
    nvlink = result.get("nvlink_gbps_per_direction") or NVLINK_GBPS_PER_DIRECTION
    styles = {"symm kernel": "-", "symm phase": "--", "torch phase": ":"}
    markers = "osD^vP*Xh<>"
    transfers = sorted({transfer for _, transfer in series})
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 5))
    for (transport, transfer), points in sorted(series.items()):
        points.sort()
        index = transfers.index(transfer)
        ax.plot([t for t, _ in points], [g for _, g in points], linestyle=styles.get(transport, "-."),
                marker=markers[index % len(markers)], markersize=4, color=colors(index % 10),
                label=f"{transport}: {transfer}")
    ax.axhline(nvlink, color="black", linewidth=1.2)
    ax.text(0.01, nvlink, f" NVLink {nvlink:.0f} GB/s per direction", transform=ax.get_yaxis_transform(),
            va="bottom", fontsize=8)
    target = result.get("dispatch_target")
    if target:  # issue 11: dispatch PUT at the largest token count >= 60% of NVLink
        ax.axhline(0.6 * nvlink, color="gray", linewidth=0.8, linestyle="--")
        ax.text(0.01, 0.6 * nvlink, " 60% of NVLink (issue 11 target for dispatch PUT)",
                transform=ax.get_yaxis_transform(), va="bottom", fontsize=7, color="gray")
    ax.set_xscale("log", base=2)
    tokens = sorted({t for points in series.values() for t, _ in points})
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.minorticks_off()
    ax.set_ylim(0, max(nvlink, max(g for points in series.values() for _, g in points)) * 1.1)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("GB/s per GPU (rows that cross to another rank)")
    setup = result.get("setup", {})
    world = result.get("world_size", "?")
    ax.set_title(f"Row-transfer bandwidth, {world} ranks, {device_of(data)}\n"
                 f"top-{setup.get('topk', '?')}, hidden {setup.get('hidden', '?')}, "
                 f"{setup.get('experts', '?')} experts, {result.get('dtype', 'bf16')}; median rank", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    _save(fig, out_path)
    plt.close(fig)


def plot_mxfp8_loss(plt, data: dict, out_path: Path) -> None:
    """mxfp8_loss_*.json (tools/mxfp8_loss_curve.py): result.{steps, loss_bf16, loss_mxfp8, window,
    window_mean_bf16, window_mean_mxfp8, case}."""
    result = data["result"]
    steps, bf16, mxfp8 = result.get("steps"), result.get("loss_bf16"), result.get("loss_mxfp8")
    if not (steps and bf16 and mxfp8) or not len(steps) == len(bf16) == len(mxfp8):
        raise Skip("needs steps, loss_bf16 and loss_mxfp8 of equal length")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    top.plot(steps, bf16, color="#4c72b0", linewidth=1.6, label="BF16 dispatch")
    top.plot(steps, mxfp8, color="#dd8452", linewidth=1.2, linestyle="--", label="MXFP8 dispatch")
    if all(v > 0 for v in bf16 + mxfp8):
        top.set_yscale("log")
    window = result.get("window")
    if window and "window_mean_bf16" in result and "window_mean_mxfp8" in result:
        top.axvspan(window[0], window[1], color="gray", alpha=0.15)
        top.text(window[0], max(bf16[0], mxfp8[0]),
                 f"steps {window[0]}-{window[1]} mean\nBF16 {result['window_mean_bf16']:.5f}\n"
                 f"MXFP8 {result['window_mean_mxfp8']:.5f}", fontsize=8, va="top", ha="right")
    top.set_ylabel("loss (log scale)")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    top.set_title(f"BF16 vs MXFP8 dispatch, training loss, {result.get('case', '?')}, {device_of(data)}",
                  fontsize=10)
    bottom.plot(steps, [m - b for b, m in zip(bf16, mxfp8)], color="#55a868", linewidth=1.2)
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_ylabel("MXFP8 - BF16")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, out_path)
    plt.close(fig)


# (result name, which is also the option naming one file, output file, plotter)
FIGURES = (
    ("moe_layer", "layer_time.png", plot_layer_time),
    ("ep_layer", "ep_layer_time.png", plot_ep_layer_time),
    ("transport", "transport_gbps.png", plot_transport),
    ("mxfp8_loss", "mxfp8_loss.png", plot_mxfp8_loss),
)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS_DIR), help="directory of result JSON (default: %(default)s)")
    parser.add_argument("--out", default=str(FIGURES_DIR), help="directory for the PNGs (default: %(default)s)")
    for name, _, _ in FIGURES:
        parser.add_argument(f"--{name.replace('_', '-')}", metavar="JSON",
                            help=f"this {name} result instead of the newest {name}_*.json")
    return parser.parse_args(argv)


def _shown(path: Path) -> str:
    """Relative to the working directory when under it, else as given."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return str(path) if relative.startswith("..") else relative


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot_benchmarks: matplotlib is missing: {INSTALL_HINT}", file=sys.stderr)
        return 2
    results_dir, out_dir = Path(args.results), Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        print(f"plot_benchmarks: --out {args.out} is a file; give a folder for the PNGs", file=sys.stderr)
        return 2
    written = 0
    for name, filename, plotter in FIGURES:
        chosen = getattr(args, name)
        source = Path(chosen) if chosen else newest_result(results_dir, name)
        if source is None:
            print(f"skip {filename}: no {name}_*.json from a GPU in {_shown(results_dir)}")
            continue
        if not source.is_file():
            print(f"skip {filename}: {_shown(source)} does not exist")
            continue
        out_path = out_dir / filename
        try:
            data = load(source)
            out_dir.mkdir(parents=True, exist_ok=True)
            plotter(plt, data, out_path)
        except Skip as why:
            plt.close("all")
            print(f"skip {filename}: {_shown(source)}: {why}")
            continue
        except (KeyError, TypeError, ValueError, IndexError) as error:  # a result of another shape
            plt.close("all")
            print(f"skip {filename}: {_shown(source)} is not shaped like a {name} result "
                  f"({type(error).__name__}: {error})")
            continue
        written += 1
        print(f"wrote {_shown(out_path)} ({out_path.stat().st_size // 1024} KB) from {_shown(source)}")
    if not written:
        print(f"plot_benchmarks: no figure written (no usable result JSON in {_shown(results_dir)})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
