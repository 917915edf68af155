"""argparse types the benchmarks share: a value out of range is refused by argparse, naming the option,
before anything is measured."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive number or inf, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. 1,4,16."""
    values = []
    for part in text.split(","):
        try:
            values.append(positive_int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected positive integers A,B,..., got {text!r}") from None
    return values


def names_from(choices: tuple[str, ...]) -> Any:
    """A type for a comma-separated list of names out of `choices`."""

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def existing_path(text: str) -> str:
    """A file or directory that exists (a checkpoint), refused before any work if it does not."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r}")
    return text
