"""argparse types shared by the tools: a bad value is a usage error (exit 2, one line saying what
was expected), checked before any GPU or process group is touched."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def number_at_least(kind: type, bound: float, strict: bool = False) -> Callable[[str], float]:
    """A `kind` value >= bound (> bound when strict)."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (value > bound if strict else value >= bound) or value in (float("inf"), float("-inf")):
            # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"expected {noun} {'>' if strict else '>='} {bound}, got {value}")
        return value
    return parse


positive_int = number_at_least(int, 1)
non_negative_int = number_at_least(int, 0)
positive_float = number_at_least(float, 0, strict=True)


def list_of(item: Callable[[str], object], noun: str) -> Callable[[str], list]:
    """A comma-separated list, each entry parsed by `item` (an argparse type)."""

    def parse(text: str) -> list:
        parts = [part for part in text.split(",") if part]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}")
        values = []
        for part in parts:
            try:
                values.append(item(part))
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"{noun}: {error}") from None
        return values
    return parse


def names_from(allowed: Iterable[str], noun: str = "names") -> Callable[[str], str]:
    """A comma-separated subset of `allowed`, kept as the original string (the tools split it)."""
    allowed = tuple(allowed)

    def parse(text: str) -> str:
        unknown = [name for name in text.split(",") if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {noun} {unknown}; choose from {', '.join(allowed)}")
        return text
    return parse
