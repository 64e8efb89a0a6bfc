"""The one-GPU layer benchmarks' shape flags, with the reference shape as defaults (issue 17's:
8192 tokens, 64 experts, top-8, hidden 2048, ffn 1024)."""

from __future__ import annotations

import argparse


def add_layer_shape_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    return parser
