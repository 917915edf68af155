"""The `ember` command. Subcommands import their heavy dependencies only when they run, so the
operator image (no torch) can run `ember operator` from the same entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ember_engine import __version__


def _make_test_model(args: argparse.Namespace) -> int:
    from ember_engine.testmodel import make_test_model

    try:
        out = make_test_model(args.dir, size=args.size, seed=args.seed, force=args.force)
    except FileExistsError as exc:
        print(f"ember make-test-model: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a {args.size} test checkpoint to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ember_engine import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember", description="ember: LLM serving engine and Kubernetes operator"
    )
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("make-test-model", help="write a random-weight Llama checkpoint with a real tokenizer")
    p.add_argument("dir", help="output directory")
    p.add_argument(
        "--size", default="tiny", choices=["tiny", "small"], help="tiny (~1.6M params) or small (~57M)"
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    p.set_defaults(func=_make_test_model)

    from ember_engine import serve  # argparse only at import time

    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_arguments(p)
    p.set_defaults(func=serve.main)

    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    from ember_engine import bench_throughput  # argparse only at import time

    p = bench_sub.add_parser("throughput", help="offline output tokens/s, ember vs transformers")
    bench_throughput.add_arguments(p)
    p.set_defaults(func=bench_throughput.main)

    from ember_engine import bench_serve

    p = bench_sub.add_parser("serve", help="serving latency and throughput against a running server")
    bench_serve.add_arguments(p)
    p.set_defaults(func=bench_serve.main)

    from ember_e2e import bench_scale

    p = bench_sub.add_parser("scale", help="load spike to added capacity serving: warm pool vs cold start")
    bench_scale.add_arguments(p)
    p.set_defaults(func=bench_scale.main)

    from ember_operator import main as operator_main  # argparse only at import time: no kopf yet

    p = sub.add_parser("operator", help="run the Kubernetes operator for InferenceServices (kopf)")
    operator_main.add_arguments(p)
    p.set_defaults(func=operator_main.main)

    from ember_e2e import devcluster  # argparse only at import time

    p = sub.add_parser(
        "dev", help="a local control plane: API server, process kubelet, service proxy, operator"
    )
    devcluster.add_arguments(p)

    p = sub.add_parser("demo", help="generate from a test checkpoint built on the spot")
    p.add_argument("--dir", help="checkpoint directory (default: a per-user cache)")
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
