"""The GPU's SM clock, power and clock-limit reasons while a measurement runs, sampled by
`nvidia-smi` (no NVML binding needed). Under this project's load the H200's SM clock leaves
1980 MHz in bursts (BENCHMARKS.md, eighth session), so two paths timed at different moments can
differ by their clocks rather than their kernels; a path that keeps the GPU busier (a CUDA graph,
no idle gaps) may also run hotter. `bench_graphs` records each timed run's clocks beside its time
so such a difference shows. The clock-limit reasons tell why a clock dropped: NVML's software
power cap (the board at its power limit, so a step's time follows its energy rather than its
kernels' latency), or thermal and hardware slowdowns.

    with ClockSampler(device_index) as clocks:
        times = cuda_time_ms(step, ...)
    clocks.summary()  # {"samples", "sm_mhz_median", "sm_mhz_min", "power_w_median", "power_limit_w",
                      #  "power_capped_fraction", "thermal_fraction"} or {"samples": 0, ...}
"""

from __future__ import annotations

import statistics
import subprocess
from dataclasses import dataclass

BASE_QUERY = "clocks.sm,power.draw"
# The limit reasons as NVML's bitmask (nvidia-smi prints it in hex) and the enforced power limit; a
# driver that knows neither field name gets BASE_QUERY alone.
FULL_QUERY = BASE_QUERY + ",clocks_throttle_reasons.active,enforced.power.limit"
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
THERMAL_OR_HW = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW / HW thermal slowdown, HW power brake


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    power_w: float
    reasons: int | None = None  # NVML's clock-limit reason bits; None from BASE_QUERY
    power_limit_w: float | None = None


def parse_samples(text: str) -> list[Sample]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines of BASE_QUERY or FULL_QUERY -> samples;
    lines whose clock or power is not a number ("[N/A]", a partial last line) are skipped, and a
    reason mask or limit that is not one is left None."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) not in (2, 4):
            continue
        try:
            mhz, watts = float(fields[0]), float(fields[1])
        except ValueError:
            continue
        reasons = limit = None
        if len(fields) == 4:
            reasons = _number(fields[2], lambda text: int(text, 16))
            limit = _number(fields[3], float)
        samples.append(Sample(mhz, watts, reasons, limit))
    return samples


def _number(text: str, parse):
    try:
        return parse(text)
    except ValueError:
        return None


def summarize(samples: list[Sample], unavailable: str | None = None) -> dict:
    if not samples:
        return {"samples": 0, "unavailable": unavailable or "no sample taken (the block ran shorter than one "
                                                            "sampling interval)"}
    clocks = [sample.sm_mhz for sample in samples]
    summary = {"samples": len(samples), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
               "power_w_median": statistics.median(sample.power_w for sample in samples)}
    masks = [sample.reasons for sample in samples if sample.reasons is not None]
    if masks:
        summary["power_capped_fraction"] = sum(bool(mask & SW_POWER_CAP) for mask in masks) / len(masks)
        summary["thermal_fraction"] = sum(bool(mask & THERMAL_OR_HW) for mask in masks) / len(masks)
    limits = [sample.power_limit_w for sample in samples if sample.power_limit_w is not None]
    if limits:
        summary["power_limit_w"] = statistics.median(limits)
    return summary


class ClockSampler:
    """Samples GPU `index`'s SM clock, power and clock-limit reasons every `interval_ms` while the
    `with` block runs (entering waits for nvidia-smi's first sample, which is not kept). Without
    nvidia-smi the summary says so and the block runs unchanged."""

    def __init__(self, index: int = 0, interval_ms: int = 20, command: str = "nvidia-smi"):
        self.command, self.index, self.interval_ms = command, index, interval_ms
        self.process = None
        self.samples: list[Sample] = []
        self.unavailable: str | None = None

    def argv(self, query: str) -> list[str]:
        return [self.command, f"--id={self.index}", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                f"--loop-ms={self.interval_ms}"]

    def __enter__(self) -> ClockSampler:
        for query in (FULL_QUERY, BASE_QUERY):
            argv = self.argv(query)
            try:
                self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError as error:
                self.unavailable = f"{self.command} could not start: {error}"
                return self
            # Its first sample (taken before the block) says sampling runs: NVML's start-up can take
            # longer than a short block. An exit before any sample (a field this driver does not
            # know) ends the wait too (EOF), and the base query is tried.
            if parse_samples(self.process.stdout.readline()):
                self.unavailable = None
                return self
            self.unavailable = f"{' '.join(argv)} gave no sample"
            self._stop()
        return self

    def _stop(self) -> str:
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.unavailable is None:
            self.samples = parse_samples(self._stop())

    def summary(self) -> dict:
        return summarize(self.samples, self.unavailable)
