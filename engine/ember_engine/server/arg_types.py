"""The types of `ember serve`'s numeric options: a value out of range is refused by argparse, naming it."""

from __future__ import annotations

import argparse


def seconds(text: str) -> float:
    seconds = float(text)
    if not (seconds >= 0 and seconds != float("inf")):  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {text}")
    return seconds


def byte_size(text: str) -> int:
    size = int(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more bytes, not {text}")
    return size


def log_interval(text: str) -> float:
    seconds = float(text)
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more seconds, not {text}")
    return seconds
