"""The layer benchmarks' shape flags, with the reference shape as defaults (issue 17's: 8192
tokens, 64 experts, top-8, hidden 2048, ffn 1024); a tool may give other defaults. Values are
checked as they are parsed (megatron_ext/bench/cli_types.py), the top-k against the experts by
`check_layer_shape`."""

from __future__ import annotations

import argparse

from megatron_ext.bench.cli_types import positive_float, positive_int

REFERENCE_SHAPE = {"tokens": 8192, "experts": 64, "topk": 8, "hidden": 2048, "ffn": 1024, "capacity_factor": 1.25}


def add_layer_shape_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    shape = {**REFERENCE_SHAPE, **defaults}
    for name in ("tokens", "experts", "topk", "hidden", "ffn"):
        parser.add_argument(f"--{name}", type=positive_int, default=shape[name])
    parser.add_argument("--capacity-factor", type=positive_float, default=shape["capacity_factor"])
    return parser


def check_layer_shape(parser: argparse.ArgumentParser, args) -> None:
    check_topk(parser, args.topk, args.experts)


def check_topk(parser: argparse.ArgumentParser, topk: int, experts: int) -> None:
    """A usage error (exit 2) before anything runs: a token routes to top-k distinct experts."""
    if topk > experts:
        parser.error(f"--topk {topk} is more than --experts {experts}: a token routes to distinct experts")
