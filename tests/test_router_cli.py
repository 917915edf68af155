"""`ember router`'s numeric options: a value it cannot run with is refused by name before it serves."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ember_router import main as router_main


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [
        # inf passed, then every request with two engines or more was a 500 (OverflowError in the bound)
        ("--epsilon", "inf", r"--epsilon must be a finite number >= 0, got inf"),
        ("--epsilon", "nan", r"--epsilon must be a finite number >= 0, got nan"),
        ("--epsilon", "-0.5", r"--epsilon must be a finite number >= 0, got -0.5"),
        # 0 or less polled the engines in a tight loop
        ("--poll-interval", "0", r"--poll-interval must be a finite number > 0, got 0"),
        ("--poll-interval", "-1", r"--poll-interval must be a finite number > 0, got -1"),
        ("--poll-interval", "inf", r"--poll-interval must be a finite number > 0, got inf"),
        # a negative hold was taken as none, nan as none too
        ("--hold-seconds", "-1", r"--hold-seconds must be a finite number >= 0, got -1"),
        ("--hold-seconds", "nan", r"--hold-seconds must be a finite number >= 0, got nan"),
        ("--drain-timeout", "-1", r"--drain-timeout must be a finite number >= 0, got -1"),
        ("--upstream-timeout", "0", r"--upstream-timeout must be a finite number > 0, got 0"),
    ],
)
def test_a_number_the_router_cannot_run_with_is_refused_by_name(
    flag: str, value: str, error: str, tiny_model: Path
) -> None:
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_model), "--endpoint", "http://127.0.0.1:9", f"{flag}={value}"]
    )
    with pytest.raises(SystemExit, match=rf"^ember router: {error}$"):
        router_main.build(args)
