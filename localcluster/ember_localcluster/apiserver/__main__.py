"""Serve the in-process API server until SIGINT/SIGTERM: `python -m ember_localcluster.apiserver`."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

import yaml

from .server import APIServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember_localcluster.apiserver", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for the server here")
    parser.add_argument(
        "--crd", type=Path, action="append", default=[], help="install this CRD manifest at start"
    )
    parser.add_argument(
        "--no-pod-graceful-deletion",
        action="store_true",
        help="delete Pods at once (no kubelet will confirm)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s"
    )

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with APIServer(args.host, args.port, pod_graceful_deletion=not args.no_pod_graceful_deletion) as server:
        for path in args.crd:
            for document in yaml.safe_load_all(path.read_text()):
                if document:
                    server.install_crd(document)
        if args.kubeconfig:
            server.write_kubeconfig(args.kubeconfig)
            print(f"kubeconfig written to {args.kubeconfig}", flush=True)
        print(f"serving the Kubernetes API on {server.url}", flush=True)
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
