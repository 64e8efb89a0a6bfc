"""The tools refuse bad values as usage errors (exit 2, one line, no traceback) before they touch a
GPU or start ranks; the shared argparse types say what was expected."""

import argparse
import os
import subprocess
import sys

import pytest

from megatron_ext.bench.cli_types import list_of, names_from, positive_float, positive_int

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tool,flags,message", [
    ("bench_transport.py", ["--transports", "foo"], "unknown transports ['foo']; choose from symm, torch"),
    ("bench_transport.py", ["--tokens", "12,abc"], "token counts: expected an integer, got 'abc'"),
    ("bench_transport.py", ["--kernel-configs", "4096x8,3000x4"],
     "kernel configurations: BLOCK_H must be a power of two in [1, 65536], got 3000 in '3000x4'"),
    ("bench_transport.py", ["--kernel-configs", "4096"], "expected BLOCK_HxWARPS such as 4096x8, got '4096'"),
    ("bench_ep.py", ["--iters", "0"], "argument --iters: expected an integer >= 1, got 0"),
    ("bench_ep.py", ["--device", "cpu", "--tiny", "--topk", "99"], "--topk 99 is more than --experts 8"),
    ("bench_transport.py", ["--device", "cpu", "--tiny", "--topk", "9"], "--topk 9 is more than --experts 8"),
    ("dropless_memory_probe.py", ["--ep", "0"], "EP sizes: expected an integer >= 1, got 0"),
    ("dropless_memory_probe.py", ["--arena-budget", "1.0,2.0"], "RF <= CF"),
    ("host_sync_audit.py", ["--topk", "20"], "--topk 20 is more than --experts 16"),
    ("bench_graphs.py", ["--tokens", "0"], "token counts: expected an integer >= 1, got 0"),
    ("bench_graphs.py", ["--tokens", "1024", "--profile", "2048"], "--profile 2048 must be one of --tokens [1024]"),
    ("bench_moe_layer.py", ["--paths", "nope"], "unknown paths ['nope']"),
    ("bench_host_trees.py", ["--rounds", "0"], "argument --rounds: expected an integer >= 1, got 0"),
    ("bench_host_cold.py", ["--iters", "0"], "argument --iters: expected an integer >= 1, got 0"),
    ("bench_host_affinity.py", ["--rounds", "-1"], "argument --rounds: expected an integer >= 1, got -1"),
    ("bench_wgrad.py", ["--tiles", "128x128x32"], "tile configurations: tiles must be block_m x block_n x "
                                                  "block_rows x warps x stages"),
    ("bench_wgrad.py", ["--capacity-factor", "0.5"], "--capacity-factor must be >= 1"),
])
def test_bad_values_are_usage_errors(tool, flags, message):
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", tool), *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and message in result.stderr.strip().splitlines()[-1], result.stderr


def test_shared_types():
    assert list_of(positive_int, "sizes")("2,4") == [2, 4]
    assert names_from(("a", "b"))("b,a") == "b,a"
    for parse, text in ((positive_float, "nan"), (positive_float, "inf"), (positive_float, "0"), (positive_int, "1.5"),
                        (list_of(positive_int, "sizes"), ","), (names_from(("a",)), "a,c")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
