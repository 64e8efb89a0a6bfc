"""bench/gpu_clocks.py: nvidia-smi's samples parsed, a fake sampler's samples kept only from inside
the block, and a missing nvidia-smi reported instead of failing the measurement."""

from __future__ import annotations

import os
import sys
import time

from megatron_ext.bench.gpu_clocks import ClockSampler, parse_samples, summarize

FAKE_SMI = """#!{python}
import sys, time
print("1500, 100.0", flush=True)  # the first sample, before the block: not kept
i = 0
while True:
    i += 1
    print(f"{{1980 if i % 2 else 1700}}, {{400 + i}}.0", flush=True)
    print("[N/A], [N/A]", flush=True)
    time.sleep(0.005)
"""


def test_parse_samples_skips_what_is_not_two_numbers():
    text = "1980, 451.20\n[N/A], 300.00\n1755, [N/A]\n1830, 402.5\n1900"
    assert parse_samples(text) == [(1980.0, 451.2), (1830.0, 402.5)]


def test_summary_of_samples_and_of_none():
    assert summarize([(1980.0, 400.0), (1700.0, 500.0), (1800.0, 450.0)]) == {
        "samples": 3, "sm_mhz_median": 1800.0, "sm_mhz_min": 1700.0, "power_w_median": 450.0}
    assert summarize([], "nvidia-smi could not start")["unavailable"] == "nvidia-smi could not start"
    assert summarize([])["samples"] == 0


def test_fake_sampler_keeps_only_samples_from_inside_the_block(tmp_path):
    fake = tmp_path / "fake-smi"
    fake.write_text(FAKE_SMI.format(python=sys.executable))
    os.chmod(fake, 0o755)
    with ClockSampler(index=0, interval_ms=5, command=str(fake)) as clocks:
        time.sleep(0.2)
    summary = clocks.summary()
    assert summary["samples"] >= 2 and "unavailable" not in summary
    assert {mhz for mhz, _ in clocks.samples} <= {1980.0, 1700.0}  # never the 1500 taken before the block
    assert summary["sm_mhz_min"] in (1700.0, 1980.0) and summary["power_w_median"] > 400.0


def test_missing_nvidia_smi_is_reported_and_the_block_runs(tmp_path):
    ran = []
    with ClockSampler(command=str(tmp_path / "no-such-smi")) as clocks:
        ran.append(True)
    assert ran == [True]
    summary = clocks.summary()
    assert summary["samples"] == 0 and "could not start" in summary["unavailable"]
