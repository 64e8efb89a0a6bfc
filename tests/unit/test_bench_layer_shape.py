"""megatron_ext/bench/layer_shape.py: the layer benchmarks' shape flags default to issue 17's
reference shape (8192 tokens, 64 experts, top-8, hidden 2048, ffn 1024, capacity factor 1.25),
a tool's own defaults replace only what it names, and a top-k up to the expert count is accepted."""

import argparse

import pytest

from megatron_ext.bench.layer_shape import add_layer_shape_args, check_layer_shape, check_topk


def _parse(argv, **defaults):
    parser = add_layer_shape_args(argparse.ArgumentParser(), **defaults)
    return parser, parser.parse_args(argv)


def test_defaults_are_the_reference_shape():
    _, args = _parse([])
    assert (args.tokens, args.experts, args.topk, args.hidden, args.ffn) == (8192, 64, 8, 2048, 1024)
    assert args.capacity_factor == 1.25


def test_a_tools_defaults_replace_only_what_it_names():
    _, args = _parse([], tokens=4096, experts=16)
    assert (args.tokens, args.experts, args.topk, args.hidden, args.ffn) == (4096, 16, 8, 2048, 1024)
    _, args = _parse(["--tokens", "64", "--capacity-factor", "2"], tokens=4096)
    assert args.tokens == 64 and args.capacity_factor == 2.0


def test_topk_may_equal_the_experts_but_not_exceed_them(capsys):
    """A token routes to top-k distinct experts: k == E is every expert (valid), k == E + 1 is a
    usage error (exit 2) naming both flags."""
    parser, args = _parse(["--experts", "8", "--topk", "8"])
    check_layer_shape(parser, args)  # no error
    check_topk(parser, 1, 1)
    with pytest.raises(SystemExit) as exit_info:
        check_topk(parser, 9, 8)
    assert exit_info.value.code == 2
    assert "--topk 9 is more than --experts 8" in capsys.readouterr().err
