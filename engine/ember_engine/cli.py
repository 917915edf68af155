"""The `ember` command: a thin dispatcher.

Each command lives in its own module, which provides `add_arguments(parser)` and `main(args)`. Only the
module of the command being run is imported (not even to build `--help` for the others), so the operator
image (no torch) can run `ember operator` from the same entry point and `ember --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ember_engine import __version__

# command -> (module, help); "bench" has benchmarks of its own.
COMMANDS: dict[str, tuple[str, str]] = {
    "make-test-model": (
        "ember_engine.tools.testmodel",
        "write a random-weight Llama checkpoint with a real tokenizer",
    ),
    "make-spec-pair": (
        "ember_engine.tools.spec_pair",
        "train a small target/draft Llama pair for speculative decoding",
    ),
    "serve": ("ember_engine.server.serve", "serve a model over the OpenAI API"),
    "quantize": (
        "ember_engine.tools.quantize",
        "write a quantized copy of a checkpoint (compressed-tensors: fp8, w8a16, w4a16, w8a8)",
    ),
    "fetch-model": (
        "ember_engine.fetch.cli",
        "fetch a checkpoint (hf://, s3://, a directory) into a directory, resumably, checking digests",
    ),
    "router": ("ember_router.main", "route requests to engines by cached prefix and load (OpenAI API)"),
    "operator": ("ember_operator.main", "run the Kubernetes operator for InferenceServices (kopf)"),
    "dev": (
        "ember_localcluster.devcluster",
        "a local control plane: API server, process kubelet, service proxy, operator",
    ),
    "demo": (
        "ember_localcluster.demo",
        "the operator end to end on the local control plane, narrated (make demo)",
    ),
    "demo-engine": (
        "ember_engine.tools.demo",
        "serve the packaged model pair with speculative decoding and stream from it",
    ),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("ember_engine.bench.throughput", "offline output tokens/s, ember vs transformers"),
    "serve": ("ember_engine.bench.serve", "serving latency and throughput against a running server"),
    "spec": ("ember_engine.bench.spec", "speculative decoding (draft, n-gram) against plain decoding"),
    "lora": ("ember_engine.bench.lora", "LoRA adapters (one, and several mixed) against the base model"),
    "quant": (
        "ember_engine.bench.quant",
        "quantized weights (fp8, w8a16, w4a16, w8a8) against full precision",
    ),
    "gemm": ("ember_engine.bench.gemm", "each quantized layer's product against full precision's, by shape"),
    "step": ("ember_engine.bench.step", "host time per engine step, model forward stubbed, by component"),
    "scale": (
        "ember_localcluster.bench_scale",
        "load spike to added capacity serving: warm pool vs cold start",
    ),
    "fleet": (
        "ember_localcluster.bench_fleet",
        "a fleet behind its Service (round robin) and behind ember router, side by side",
    ),
    "operator": (
        "ember_localcluster.bench_operator",
        "the operator's API requests, CPU and reconcile latency at fleet size (fake pods)",
    ),
}
BENCH_HELP = "benchmarks (ratios measured side by side in one run)"


def _positionals(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def _attach(p: argparse.ArgumentParser, module_name: str) -> None:
    module = importlib.import_module(module_name)
    module.add_arguments(p)
    p.set_defaults(func=module.main)


def _add_bench(sub: argparse._SubParsersAction, words: list[str] | None) -> None:
    bench = sub.add_parser("bench", help=BENCH_HELP, description=BENCH_HELP)
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, (module_name, text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=text, description=text)
        if words is None or words[:2] == ["bench", name]:
            _attach(p, module_name)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line. With `argv`, only the command it names has its module imported (and its options
    parsed); without, every command's (the whole parser, for tools and tests)."""
    words = _positionals(argv) if argv is not None else None
    chosen = words[0] if words else None
    parser = argparse.ArgumentParser(
        prog="ember", description="ember: LLM serving engine and Kubernetes operator"
    )
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if words is None or name == chosen:
            _attach(p, module_name)
        if name == "serve":  # benchmarks follow the server in the listing
            _add_bench(sub, words)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
