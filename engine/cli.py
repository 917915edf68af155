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


def _make_spec_pair(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ember_engine import spec_pair

    out = Path(args.dir) if args.dir else spec_pair.PACKAGED_DIR
    try:
        target, draft = spec_pair.make_spec_pair(out, force=args.force, log=print)
    except FileExistsError as exc:
        print(f"ember make-spec-pair: {exc}", file=sys.stderr)
        return 1
    r = json.loads((out / "training.json").read_text())
    for name, path in (("target", target), ("draft", draft)):
        m = r[name]
        print(
            f"{name}: {path} ({m['size']['num_hidden_layers']} layers, {m['parameters']:,} parameters, "
            f"{m['bytes'] / 1e6:.1f} MB) train loss {m['train_loss']:.3f}, held-out loss {m['held_out_loss']:.3f}"
        )
    print(f"held-out top-1 agreement (draft == target): {r['held_out_agreement']:.3f}")
    total = (r["target"]["bytes"] + r["draft"]["bytes"]) / 1e6
    print(f"total {total:.1f} MB on disk; trained in {r['wall_seconds']:.0f} s")
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

    p = sub.add_parser(
        "make-spec-pair", help="train a small target/draft Llama pair for speculative decoding"
    )
    p.add_argument("dir", nargs="?", help="output directory (default: the pair packaged with ember)")
    p.add_argument("--force", action="store_true", help="overwrite an existing pair")
    p.set_defaults(func=_make_spec_pair)

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

    from ember_engine import bench_spec

    p = bench_sub.add_parser("spec", help="speculative decoding (draft, n-gram) against plain decoding")
    bench_spec.add_arguments(p)
    p.set_defaults(func=bench_spec.main)

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

    p = sub.add_parser(
        "demo", help="serve the packaged model pair with speculative decoding and stream from it"
    )
    p.add_argument("--dir", help="serve this checkpoint instead (a tiny test model is built there if empty)")
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
