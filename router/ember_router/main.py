"""`ember router`: run the router in front of a set of engines."""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import TYPE_CHECKING

from ember_engine.server import api_keys, arg_types

if TYPE_CHECKING:
    from ember_router.proxy import Router


def _tokenizer_dir(model: str, tokenizer: str | None) -> str:
    """Where the engines' tokenizer is: `tokenizer`, or for a GGUF file the directory the engine describes
    it as (`gguf.directory.materialize`), else the checkpoint directory. The GGUF reader (and torch, which
    it imports) is loaded only for a GGUF file."""
    from ember_engine.core.config import is_gguf

    if is_gguf(model):
        from ember_engine.model.gguf import directory as gguf_dir

        return str(gguf_dir.materialize(model, tokenizer))
    return tokenizer or model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory whose tokenizer and chat template the engines use, or the GGUF file they "
        "serve (its tokenizer: --tokenizer, else the one beside it, else the one it carries)",
    )
    p.add_argument(
        "--tokenizer",
        help="the directory of the tokenizer files when they are not the model's (a GGUF file's base model)",
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="an engine's base URL, e.g. http://10.0.0.7:8000 (repeat for each engine)",
    )
    p.add_argument(
        "--kube-selector",
        help="find the engines in Kubernetes instead: Ready pods matching this label selector, e.g. "
        "app.kubernetes.io/instance=chat,ember.dev/role=active",
    )
    p.add_argument(
        "--kube-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="namespace of those pods (default $POD_NAMESPACE or default)",
    )
    p.add_argument("--engine-port", type=int, default=8000, help="the engines' port (default 8000)")
    p.add_argument("--kubeconfig", help="a kubeconfig (default: in-cluster, else ~/.kube/config)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--epsilon",
        type=float,
        default=0.25,
        help="bounded load: no engine takes more than (1 + epsilon) x the mean load (default 0.25)",
    )
    p.add_argument(
        "--poll-interval", type=float, default=0.2, help="seconds between engine polls (default 0.2)"
    )
    p.add_argument(
        "--session-header", default="x-session-id", help="header that keeps a client on its engine"
    )
    p.add_argument(
        "--policy",
        help="the engines' policy file (YAML); its fallback takes what no engine can, and the file is re-read "
        "while the router runs (the operator mounts the InferenceService's policy ConfigMap here)",
    )
    p.add_argument(
        "--fallback-url",
        help="without --policy: an OpenAI-compatible server for requests no engine can take (e.g. a smaller "
        "model's Service)",
    )
    p.add_argument(
        "--fallback-model",
        help="the model name to send to the fallback (default: the first one its /v1/models lists)",
    )
    p.add_argument(
        "--fallback-when",
        default="Overloaded,Unavailable",
        help="when the fallback takes a request, comma-separated: Overloaded (the engines refused it), "
        "Unavailable (no engine Ready) (default both)",
    )
    p.add_argument(
        "--fallback-timeout",
        type=float,
        default=None,
        help="seconds to wait for the fallback to connect and for each next piece of its answer before it "
        "counts as failed (default 30, as the policy file's fallback.timeoutSeconds)",
    )
    p.add_argument(
        "--route",
        action="append",
        default=[],
        help='a model-routing rule as JSON, e.g. {"name": "short", "target": "small", "url": '
        '"http://small.default.svc", "maxMaxTokens": 64} (repeat; the first rule a request meets wins)',
    )
    p.add_argument(
        "--routes",
        metavar="FILE",
        help="model-routing rules as a YAML list of what --route takes, re-read every second while the "
        "router runs (the operator's ConfigMap); instead of --route",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model names the engines serve: /v1/models lists them while no engine is Ready (a service at "
        "zero replicas, say), where it answers 503 without it",
    )
    p.add_argument(
        "--hold-seconds",
        type=float,
        default=0.0,
        help="with no engine Ready, hold a request up to this long for one (default 0: answer 503 at once); "
        "the router then counts as ready without engines",
    )
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=None,
        help="seconds to wait for an engine's next bytes (its answer's head or the next piece of its body) "
        "before answering 504 (default: no limit; the engines' own request deadline applies)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=300.0,
        help="seconds a stream may pass with nothing from its engine (or the fallback) before the router "
        "ends it with an error event (code upstream_timeout) and [DONE] (default 300; 0: no limit)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish before closing them (default 30)",
    )
    api_keys.add_argument(p)
    arg_types.add_chat_template_argument(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build(args: argparse.Namespace) -> Router:
    """The router the command line describes (not yet serving); SystemExit names a bad option."""
    from ember_engine.core.tokenizer import Tokenizer
    from ember_engine.server.policy import PolicyError, PolicyWatcher
    from ember_router.fallback import DEFAULT_TIMEOUT, from_flags
    from ember_router.pool import EnginePool
    from ember_router.proxy import Router, RouterSettings
    from ember_router.routes_file import RoutesFile
    from ember_router.rules import parse_route

    for flag, value, least in (
        ("--epsilon", args.epsilon, 0.0),
        ("--poll-interval", args.poll_interval, None),
        ("--hold-seconds", args.hold_seconds, 0.0),
        ("--drain-timeout", args.drain_timeout, 0.0),
        ("--stream-idle-timeout", args.stream_idle_timeout, 0.0),
        ("--upstream-timeout", args.upstream_timeout if args.upstream_timeout is not None else 1.0, None),
        ("--fallback-timeout", args.fallback_timeout if args.fallback_timeout is not None else 1.0, None),
    ):
        if not (math.isfinite(value) and (value >= least if least is not None else value > 0)):
            bound = f">= {least:g}" if least is not None else "> 0"
            raise SystemExit(f"ember router: {flag} must be a finite number {bound}, got {value:g}")
    try:
        routes = tuple(parse_route(text) for text in args.route)
    except ValueError as e:  # json.JSONDecodeError included
        raise SystemExit(f"ember router: --route: {e}") from None
    routes_file = None
    if args.routes:
        if routes:
            raise SystemExit("ember router: give --routes or --route, not both")
        try:
            routes_file = RoutesFile(args.routes)
        except ValueError as e:
            raise SystemExit(f"ember router: --routes {e}") from None
    when = frozenset(w.strip() for w in args.fallback_when.split(",") if w.strip())
    if not when <= {"Overloaded", "Unavailable"}:
        raise SystemExit(
            f"ember router: --fallback-when: {args.fallback_when!r}: each must be Overloaded or Unavailable"
        )
    if args.policy and (args.fallback_url or args.fallback_model or args.fallback_timeout is not None):
        raise SystemExit("ember router: --policy names the fallback; give it or --fallback-url, not both")
    if not args.endpoint and not args.kube_selector:
        raise SystemExit("ember router: give --endpoint (one per engine) or --kube-selector")
    policy = None
    if args.policy:
        try:
            policy = PolicyWatcher(args.policy)
        except PolicyError as e:
            raise SystemExit(f"ember router: invalid policy file {args.policy}: {e}") from None
    discovery = None
    if args.kube_selector:
        from ember_router.discovery import DiscoveryConfigError, PodDiscovery

        if args.endpoint:  # they were silently ignored
            raise SystemExit("ember router: give --endpoint or --kube-selector, not both")
        try:
            discovery = PodDiscovery(
                args.kube_namespace, args.kube_selector, args.engine_port, lambda _: None, args.kubeconfig
            )
        except DiscoveryConfigError as e:
            raise SystemExit(f"ember router: {e}") from None
    keys = api_keys.given_keys(args.api_key)
    if problem := api_keys.key_problem(keys):
        raise SystemExit(f"ember router: {problem}")
    tokenizer = Tokenizer(_tokenizer_dir(args.model, args.tokenizer))
    if args.chat_template is not None:  # as the engines render chats, so the prompts hash as theirs
        tokenizer.use_chat_template(args.chat_template)
    return Router(
        EnginePool(
            args.endpoint,
            poll_interval=args.poll_interval,
            headers=api_keys.bearer(keys[0] if keys else None),
        ),
        tokenizer,
        RouterSettings(
            epsilon=args.epsilon,
            session_header=args.session_header.lower(),
            fallback=from_flags(
                args.fallback_url,
                args.fallback_model,
                when,
                args.fallback_timeout if args.fallback_timeout is not None else DEFAULT_TIMEOUT,
            ),
            routes=routes,
            hold_seconds=args.hold_seconds,
            upstream_timeout=args.upstream_timeout,
            stream_idle_timeout=args.stream_idle_timeout or None,
            served_model_name=args.served_model_name[0] if args.served_model_name else None,
            served_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
            api_keys=api_keys.ApiKeys(keys),
            fallback_headers=api_keys.fallback_headers(),
        ),
        discovery=discovery,
        policy=policy,
        routes_file=routes_file,
    )


def main(args: argparse.Namespace) -> int:
    from aiohttp import web

    router = build(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # handler_cancellation: a client that goes away cancels its handler, which closes the upstream request.
    # A line per request only at debug, beside the decision's: formatting and writing it on every request
    # would cost more than the routing itself.
    web.run_app(
        router.app(),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        shutdown_timeout=args.drain_timeout,
        access_log=logging.getLogger("aiohttp.access") if args.log_level == "debug" else None,
        print=None,
    )
    return 0
