"""The GPU's SM clock and power while a measurement runs, sampled by `nvidia-smi` (no NVML binding
needed). Under this project's load the H200's SM clock leaves 1980 MHz in bursts (BENCHMARKS.md,
eighth session), so two paths timed at different moments can differ by their clocks rather than
their kernels; a path that keeps the GPU busier (a CUDA graph, no idle gaps) may also run hotter.
`bench_graphs` records each timed run's clocks beside its time so such a difference shows.

    with ClockSampler(device_index) as clocks:
        times = cuda_time_ms(step, ...)
    clocks.summary()  # {"samples", "sm_mhz_median", "sm_mhz_min", "power_w_median"} or {"samples": 0, ...}
"""

from __future__ import annotations

import statistics
import subprocess

QUERY = "clocks.sm,power.draw"


def parse_samples(text: str) -> list[tuple[float, float]]:
    """`nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits` lines ->
    (SM MHz, watts); lines that are not two numbers ("[N/A]", a partial last line) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            samples.append((float(fields[0]), float(fields[1])))
        except ValueError:
            continue
    return samples


def summarize(samples: list[tuple[float, float]], unavailable: str | None = None) -> dict:
    if not samples:
        return {"samples": 0, "unavailable": unavailable or "no sample taken (the block ran shorter than one "
                                                            "sampling interval)"}
    clocks = [mhz for mhz, _ in samples]
    return {"samples": len(samples), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w_median": statistics.median(watts for _, watts in samples)}


class ClockSampler:
    """Samples GPU `index`'s SM clock and power every `interval_ms` while the `with` block runs
    (entering waits for nvidia-smi's first sample, which is not kept). Without nvidia-smi the
    summary says so and the block runs unchanged."""

    def __init__(self, index: int = 0, interval_ms: int = 20, command: str = "nvidia-smi"):
        self.argv = [command, f"--id={index}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                     f"--loop-ms={interval_ms}"]
        self.process = None
        self.samples: list[tuple[float, float]] = []
        self.unavailable: str | None = None

    def __enter__(self) -> ClockSampler:
        try:
            self.process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as error:
            self.unavailable = f"{self.argv[0]} could not start: {error}"
            return self
        # Its first sample (taken before the block) says sampling runs: NVML's start-up can take longer
        # than a short block. An exit before any sample ends the wait too (EOF).
        if not parse_samples(self.process.stdout.readline()):
            self.unavailable = f"{' '.join(self.argv)} gave no sample"
        return self

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        self.samples = parse_samples(out)

    def summary(self) -> dict:
        return summarize(self.samples, self.unavailable)
