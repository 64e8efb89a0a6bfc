"""tools/plot_benchmarks.py (issue 19): figures from small synthetic result JSON shaped like the
real ones (bench_common.write_result: {"name", "env", "result"}), missing and malformed inputs
reported and skipped, and the one-line exit without matplotlib."""

from __future__ import annotations

import json
import struct
import sys
import zlib

import pytest

pytest.importorskip("matplotlib")

from tools.plot_benchmarks import main, newest_result  # noqa: E402

ENV = {"device": "NVIDIA H200", "device_count": 1, "torch": "2.11.0+cu130", "triton": "3.6.0",
       "megatron_core": "0.19.2", "cuda": "13.0", "python": "3.12.3", "host": "vm",
       "date": "2026-11-29T11:16:05+00:00"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write(directory, filename: str, name: str, result: dict, env: dict = ENV) -> None:
    (directory / filename).write_text(json.dumps({"name": name, "env": env, "result": result}))


def moe_layer_result(scale: float = 1.0) -> dict:
    rows = [{"path": path, "fwd_bwd_ms": ms * scale, "tflops": 460.0, "host_submit_ms": 4.1,
             "memory": {"peak_bytes": 3 << 30, "peak_above_baseline_bytes": 1 << 30},
             "blocking_cuda_calls": 0, "pct_dense_gemm": 55.9, "speedup_vs_megatron": None}
            for path, ms in (("rowwise_symm", 5.37), ("rowwise_symm_graph", 5.27),
                             ("rowwise_symm_mxfp8", 6.0), ("rowwise_symm_mxfp8_graph", 5.38))]
    return {"args": {"tokens": 8192, "experts": 64, "topk": 8, "hidden": 2048, "ffn": 1024,
                     "capacity_factor": 1.25, "paths": ",".join(r["path"] for r in rows)},
            "dense_gemm_tflops": 823.0, "rows": rows}


def ep_layer_result() -> dict:
    rows = [{"path": "megatron_alltoall_gg", "ranks": 8, "layer_fwd_bwd_ms": 9.1, "dispatch_combine_ms": 3.2,
             "tflops_per_gpu": 300.0},
            {"path": "rowwise_symm", "ranks": 8, "layer_fwd_bwd_ms": 7.0, "dispatch_combine_ms": 1.4,
             "tflops_per_gpu": 390.0},
            {"path": "rowwise_symm_graph", "ranks": 8, "layer_fwd_bwd_ms": 6.6, "tflops_per_gpu": 410.0},
            {"path": "rowwise_symm_mxfp8", "unavailable": "not available: the payload stays BF16"}]
    return {"shape": {"seq_length": 4096, "sequences": 4, "experts": 128, "topk": 8, "hidden": 4096, "ffn": 1536},
            "tokens_per_rank": 16384, "world_size": 8, "ep": 8, "dtype": "bf16", "rows": rows}


def transport_result() -> dict:
    rows = []
    for tokens in (1024, 2048, 4096):
        for transport, transfers in (("symm kernel", ("put_rows", "get_rows")),
                                     ("symm phase", ("dispatch", "combine")), ("torch phase", ("dispatch",))):
            for i, transfer in enumerate(transfers):
                gbps = 100.0 + tokens / 20 + 30 * i
                rows.append({"tokens": tokens, "transport": transport, "transfer": transfer, "row_bytes": 8192,
                             "routes": tokens * 8, "capacity": tokens * 10, "ms_median": 0.1,
                             "gbps_per_gpu_median": gbps, "gbps_per_gpu_slowest_rank": gbps * 0.9,
                             "remote_fraction": 0.875, "kept_fraction": 1.0, "pct_of_nvlink": gbps / 4.5})
    return {"setup": {"tokens": [1024, 2048, 4096], "experts": 128, "topk": 8, "hidden": 4096}, "world_size": 8,
            "dtype": "bf16", "nvlink_gbps_per_direction": 450.0,
            "dispatch_target": {"tokens": 4096, "gbps_per_gpu": 304.8, "fraction_of_nvlink": 0.68, "met": True},
            "notes": [], "rows": rows}


def mxfp8_loss_result(steps: int = 12) -> dict:
    bf16 = [10.6 * 0.7 ** s for s in range(steps)]
    mxfp8 = [v * (1.0 + 0.004 * ((s % 3) - 1)) for s, v in enumerate(bf16)]
    return {"case": "gpt/moe_rowwise_1gpu", "steps": list(range(1, steps + 1)), "loss_bf16": bf16,
            "loss_mxfp8": mxfp8, "max_abs_diff": max(abs(a - b) for a, b in zip(bf16, mxfp8)),
            "window": [steps - 4, steps], "window_mean_bf16": sum(bf16[-5:]) / 5,
            "window_mean_mxfp8": sum(mxfp8[-5:]) / 5, "all_finite": True, "loss_fell": True}


def assert_valid_png(path) -> None:
    """Signature, a well-formed IHDR with nonzero size (CRC checked) and an IEND chunk at the end."""
    data = path.read_bytes()
    assert len(data) > 1000, (path, len(data))
    assert data[:8] == PNG_SIGNATURE, path
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, (width, height)
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", path
    assert len(data) < 150 * 1024, (path, len(data))  # commit-ready


@pytest.fixture
def results(tmp_path):
    directory = tmp_path / "results"
    directory.mkdir()
    return directory


def test_all_figures_from_synthetic_results(results, tmp_path, capsys):
    _write(results, "moe_layer_20261129-091709.json", "moe_layer", moe_layer_result(scale=2.0))  # older
    _write(results, "moe_layer_20261129-111605.json", "moe_layer", moe_layer_result())
    _write(results, "moe_layer_profile_20261129-120000.json", "moe_layer_profile", {"rows": []})  # not a moe_layer
    _write(results, "ep_layer_20261130-080000.json", "ep_layer", ep_layer_result(),
           env=dict(ENV, device_count=8))
    _write(results, "transport_20261130-081000.json", "transport", transport_result(),
           env=dict(ENV, device_count=8))
    _write(results, "mxfp8_loss_20261129-111248.json", "mxfp8_loss", mxfp8_loss_result())
    out = tmp_path / "figures"

    assert main(["--results", str(results), "--out", str(out)]) == 0

    printed = capsys.readouterr().out
    expected = {"layer_time.png": "moe_layer_20261129-111605.json",
                "ep_layer_time.png": "ep_layer_20261130-080000.json",
                "transport_gbps.png": "transport_20261130-081000.json",
                "mxfp8_loss.png": "mxfp8_loss_20261129-111248.json"}
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    for png, source in expected.items():
        assert_valid_png(out / png)
        line = next(line for line in printed.splitlines() if png in line)
        assert line.startswith("wrote ") and line.endswith(source), line
    assert "skip" not in printed


def test_newest_result_by_file_stamp(results):
    for filename in ("moe_layer_20261129-111605.json", "moe_layer_20261129-111605-1.json",
                     "moe_layer_20261129-092354.json", "moe_layer_profile_20261130-000000.json",
                     "moe_layer_latest.json"):
        _write(results, filename, "moe_layer", moe_layer_result())
    assert newest_result(results, "moe_layer").name == "moe_layer_20261129-111605-1.json"
    assert newest_result(results, "transport") is None
    assert newest_result(results / "absent", "moe_layer") is None


def test_newest_result_leaves_out_cpu_runs(results):
    """`bench_ep --device cpu --tiny` writes into the same folder: its result must not replace the
    GPU figures; it is the newest GPU result that is plotted."""
    _write(results, "ep_layer_20261129-111605.json", "ep_layer", ep_layer_result(), env=dict(ENV, device_count=8))
    _write(results, "ep_layer_20261206-205234.json", "ep_layer", ep_layer_result(),
           env=dict(ENV, device="cpu (x86_64)", device_count=0))
    assert newest_result(results, "ep_layer").name == "ep_layer_20261129-111605.json"
    (results / "ep_layer_20261129-111605.json").unlink()
    assert newest_result(results, "ep_layer") is None


def test_missing_inputs_are_reported_and_skipped(results, tmp_path, capsys):
    _write(results, "moe_layer_20261129-111605.json", "moe_layer", moe_layer_result())
    out = tmp_path / "figures"

    assert main(["--results", str(results), "--out", str(out)]) == 0

    printed = capsys.readouterr().out.splitlines()
    assert [p.name for p in out.iterdir()] == ["layer_time.png"]
    assert_valid_png(out / "layer_time.png")
    for png, name in (("ep_layer_time.png", "ep_layer"), ("transport_gbps.png", "transport"),
                      ("mxfp8_loss.png", "mxfp8_loss")):
        skipped = [line for line in printed if line.startswith(f"skip {png}")]
        assert len(skipped) == 1 and f"no {name}_*.json" in skipped[0], printed


def test_nothing_to_plot_and_bad_inputs_exit_1_without_a_traceback(results, tmp_path, capsys):
    out = tmp_path / "figures"
    assert main(["--results", str(results / "absent"), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert printed.count("skip ") == 4 and "no figure written" in printed
    assert not out.exists()

    (results / "moe_layer_20261129-111605.json").write_text("{not json")
    _write(results, "mxfp8_loss_20261129-111248.json", "mxfp8_loss", {"steps": [1, 2], "loss_bf16": [1.0]})
    _write(results, "transport_20261130-081000.json", "transport", {"rows": [{"tokens": "many"}]})
    assert main(["--results", str(results), "--out", str(out),
                 "--ep-layer", str(results / "ep_layer_20990101-000000.json")]) == 1
    printed = capsys.readouterr().out
    assert "skip layer_time.png" in printed and "cannot read" in printed
    assert "skip ep_layer_time.png" in printed and "does not exist" in printed
    assert "skip transport_gbps.png" in printed and "skip mxfp8_loss.png" in printed
    assert not out.exists() or not list(out.iterdir())


def test_without_matplotlib_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["--results", str(tmp_path), "--out", str(tmp_path / "figures")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().count("\n") == 0
    assert "pip install 'megatron-ext[bench]'" in captured.err
    assert not (tmp_path / "figures").exists()
