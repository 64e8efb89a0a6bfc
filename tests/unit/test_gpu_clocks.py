"""bench/gpu_clocks.py: nvidia-smi's samples parsed (with and without the clock-limit reasons), a
fake sampler's samples kept only from inside the block, a driver without the reason fields sampled
by the base query, and a missing nvidia-smi reported instead of failing the measurement."""

from __future__ import annotations

import os
import sys
import time

from megatron_ext.bench.gpu_clocks import ClockSampler, Sample, parse_samples, summarize

FAKE_SMI = """#!{python}
import sys, time
if {reject_reasons} and "clocks_throttle_reasons" in " ".join(sys.argv):
    print('Field "clocks_throttle_reasons.active" is not a valid field to query.', flush=True)
    sys.exit(2)
full = "clocks_throttle_reasons" in " ".join(sys.argv)
print("1500, 100.0" + (", 0x0000000000000000, 700.00" if full else ""), flush=True)  # before the block: not kept
i = 0
while True:
    i += 1
    # odd samples at the power cap (0x4), even ones thermally slowed (0x20) and idle (0x1)
    print(f"{{1980 if i % 2 else 1700}}, {{400 + i}}.0" + (f", {{'0x4' if i % 2 else '0x21'}}, 700.00" if full else ""),
          flush=True)
    print("[N/A], [N/A]" + (", [N/A], [N/A]" if full else ""), flush=True)
    time.sleep(0.005)
"""


def fake_smi(tmp_path, reject_reasons: bool = False):
    fake = tmp_path / "fake-smi"
    fake.write_text(FAKE_SMI.format(python=sys.executable, reject_reasons=reject_reasons))
    os.chmod(fake, 0o755)
    return str(fake)


def test_parse_samples_skips_what_is_not_two_numbers():
    text = "1980, 451.20\n[N/A], 300.00\n1755, [N/A]\n1830, 402.5\n1900"
    assert parse_samples(text) == [Sample(1980.0, 451.2), Sample(1830.0, 402.5)]


def test_parse_samples_with_reasons_and_limit():
    text = "1665, 688.95, 0x0000000000000004, 700.00\n1980, 132.8, [N/A], [N/A]\n[N/A], 1.0, 0x1, 700.00"
    assert parse_samples(text) == [Sample(1665.0, 688.95, 0x4, 700.0), Sample(1980.0, 132.8, None, None)]


def test_summary_of_samples_and_of_none():
    assert summarize([Sample(1980.0, 400.0), Sample(1700.0, 500.0), Sample(1800.0, 450.0)]) == {
        "samples": 3, "sm_mhz_median": 1800.0, "sm_mhz_min": 1700.0, "power_w_median": 450.0}
    capped = summarize([Sample(1700.0, 690.0, 0x4, 700.0), Sample(1750.0, 680.0, 0x5, 700.0),
                        Sample(1980.0, 300.0, 0x0, 700.0), Sample(1900.0, 500.0, 0x20, 700.0)])
    assert capped["power_capped_fraction"] == 0.5 and capped["thermal_fraction"] == 0.25
    assert capped["power_limit_w"] == 700.0
    assert summarize([], "nvidia-smi could not start")["unavailable"] == "nvidia-smi could not start"
    assert summarize([])["samples"] == 0


def test_fake_sampler_keeps_only_samples_from_inside_the_block(tmp_path):
    with ClockSampler(index=0, interval_ms=5, command=fake_smi(tmp_path)) as clocks:
        time.sleep(0.2)
    summary = clocks.summary()
    assert summary["samples"] >= 2 and "unavailable" not in summary
    assert {s.sm_mhz for s in clocks.samples} <= {1980.0, 1700.0}  # never the 1500 taken before the block
    assert summary["sm_mhz_min"] in (1700.0, 1980.0) and summary["power_w_median"] > 400.0
    assert {s.reasons for s in clocks.samples} <= {0x4, 0x21} and summary["power_limit_w"] == 700.0
    assert 0 < summary["power_capped_fraction"] < 1
    assert summary["power_capped_fraction"] + summary["thermal_fraction"] == 1.0


def test_driver_without_reason_fields_is_sampled_by_the_base_query(tmp_path):
    with ClockSampler(index=0, interval_ms=5, command=fake_smi(tmp_path, reject_reasons=True)) as clocks:
        time.sleep(0.2)
    summary = clocks.summary()
    assert summary["samples"] >= 2 and "unavailable" not in summary
    assert all(s.reasons is None for s in clocks.samples) and "power_capped_fraction" not in summary


def test_missing_nvidia_smi_is_reported_and_the_block_runs(tmp_path):
    ran = []
    with ClockSampler(command=str(tmp_path / "no-such-smi")) as clocks:
        ran.append(True)
    assert ran == [True]
    summary = clocks.summary()
    assert summary["samples"] == 0 and "could not start" in summary["unavailable"]


def test_every_thermal_or_hardware_reason_counts_as_slowed():
    """NVML's HW slowdown (0x8), SW thermal (0x20), HW thermal (0x40) and HW power brake (0x80) each
    mark a sample as slowed; the SW power cap (0x4) and idle (0x1) do not."""
    for bit in (0x8, 0x20, 0x40, 0x80):
        summary = summarize([Sample(1500.0, 700.0, bit, 700.0), Sample(1980.0, 300.0, 0x1, 700.0)])
        assert summary["thermal_fraction"] == 0.5, hex(bit)
        assert summary["power_capped_fraction"] == 0.0, hex(bit)


def test_power_limit_is_the_median_of_the_samples_limits():
    """A limit that changed during the block (600 -> 700 -> 650 W) is reported as the median, 650."""
    samples = [Sample(1700.0, 500.0, 0x0, 600.0), Sample(1700.0, 500.0, 0x0, 700.0), Sample(1700.0, 500.0, 0x0, 650.0),
               Sample(1700.0, 500.0, None, None)]
    assert summarize(samples)["power_limit_w"] == 650.0
