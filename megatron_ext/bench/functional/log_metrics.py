"""Per-step metrics from a training log: Megatron's log lines (megatron.training 0.19.2's
`training_log` and `report_memory`), which the CPU job also prints with `--log-format megatron`.

    [2026-...] iteration        3/      50 | consumed samples: ... | elapsed time per iteration (ms): 41.2 |
        ... | lm loss: 1.034567E+01 | ... | num zeros: 12 | ...
    [Rank 0] (after 3 iterations) memory (MB) | allocated: 1234.50 | max allocated: 2345.60 | ...

Metrics returned (names as in Megatron's golden values): "lm loss", "num-zeros",
"iteration-time" (seconds), "mem-allocated-bytes", "mem-max-allocated-bytes". Lines may carry a
launcher prefix (torchrun's "[default0]:"); memory lines from several ranks keep the lowest rank.
"""

from __future__ import annotations

import re

from megatron_ext.bench.functional.compare import to_golden_format

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|(.*)$")
MEMORY_LINE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.eE+-]+) "
                         r"\| max allocated: ([\d.eE+-]+)")
FIELD = re.compile(r"\s*([^|:]+?):\s*([^|]+?)\s*\|")
MB = 1024.0 * 1024.0

# log field name -> (metric name, conversion)
ITERATION_FIELDS = {
    "lm loss": ("lm loss", float),
    "num zeros": ("num-zeros", float),
    "elapsed time per iteration (ms)": ("iteration-time", lambda text: float(text) / 1000.0),
}


def parse_log(text: str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} for every metric found; a later line for the same step wins
    (a resumed run re-logs nothing before its start step, so that never mixes two runs)."""
    series: dict[str, dict[int, float]] = {}
    memory_rank: dict[int, int] = {}
    for line in text.splitlines():
        match = ITERATION_LINE.search(line)
        if match:
            step = int(match.group(1))
            for key, value in FIELD.findall(match.group(2) + ("" if match.group(2).endswith("|") else "|")):
                if key in ITERATION_FIELDS:
                    metric, convert = ITERATION_FIELDS[key]
                    try:
                        series.setdefault(metric, {})[step] = convert(value)
                    except ValueError:
                        series.setdefault(metric, {})[step] = float("nan")
            continue
        match = MEMORY_LINE.search(line)
        if match:
            rank, step = int(match.group(1)), int(match.group(2))
            if step in memory_rank and memory_rank[step] < rank:
                continue
            memory_rank[step] = rank
            series.setdefault("mem-allocated-bytes", {})[step] = float(match.group(3)) * MB
            series.setdefault("mem-max-allocated-bytes", {})[step] = float(match.group(4)) * MB
    return series


def metrics_from_log(text: str, metrics: list[str]) -> dict:
    """The requested metrics in Megatron's golden-value format (absent metrics are left out)."""
    series = parse_log(text)
    return {metric: to_golden_format(series[metric]) for metric in metrics if series.get(metric)}
