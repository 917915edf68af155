"""`ember fetch-model SOURCE DEST`: the command the operator's init containers run (see `ember_engine.fetch`)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ember_engine.fetch.files import Fetch, FetchError, Source

PREFIX = "ember fetch-model"


def source_for(uri: str, endpoint: str | None) -> Source:
    if uri.startswith("hf://"):
        from ember_engine.fetch.hub import HubSource

        return HubSource(uri, endpoint)
    if uri.startswith("s3://"):
        from ember_engine.fetch.s3 import S3Source

        return S3Source(uri, endpoint)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", uri):
        raise FetchError(
            f"unsupported source {uri!r}: hf://org/name[@revision], s3://bucket/prefix or a directory"
        )
    from ember_engine.fetch.local import LocalSource

    return LocalSource(uri)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="hf://org/name[@revision], s3://bucket/prefix, or a directory")
    p.add_argument("dest", help="the directory to fetch into (created if missing)")
    p.add_argument("--endpoint", help="the hub's address (HF_ENDPOINT) or the S3-compatible endpoint")
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="fetch only matching files (repeatable)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip matching files (repeatable); without --include, weight formats the engine does not load "
        "(*.bin, *.pt, ...) and GGUF files (*.gguf: give --include for the one to serve) are skipped too",
    )
    p.add_argument(
        "--retries", type=_count, default=5, help="tries after a dropped transfer (default: %(default)s)"
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        help="seconds between progress lines (default: %(default)s)",
    )


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _log(message: str) -> None:
    print(f"{PREFIX}: {message}", flush=True)


def main(args: argparse.Namespace) -> int:
    try:
        fetch = Fetch(
            source_for(args.source, args.endpoint),
            Path(args.dest),
            include=args.include,
            exclude=args.exclude,
            retries=args.retries,
            progress_interval=args.progress_interval,
            log=_log,
        )
        fetch.run()
    except (FetchError, OSError) as error:
        # One line the operator reports as the pod's trouble (Stalled, ModelFetchFailed); an OSError names
        # its path (a destination that is a file, a full disk, a file it may not read).
        print(f"{PREFIX}: fatal: {error}", file=sys.stderr, flush=True)
        return 1
    return 0
