"""`ember serve`: load a model, warm it up, serve the OpenAI API; drain gracefully on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator

from ember_engine.bench.arg_types import non_negative_int
from ember_engine.core.config import CHECKPOINT_METHODS, KV_CACHE_DTYPES, QUANT_SCHEMES
from ember_engine.server import api_keys, arg_types, generation_defaults

log = logging.getLogger("ember.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory, or a .gguf file")
    p.add_argument(
        "--tokenizer",
        help="directory of the tokenizer files (tokenizer.json) when they are not --model's: a GGUF file's base "
        "model (default: the files beside it)",
    )
    arg_types.add_name_argument(p)
    api_keys.add_argument(p)
    arg_types.add_chat_template_argument(p)
    generation_defaults.add_arguments(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", help="policy file (YAML): shedding, priority classes, fallback, deadlines")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--kv-cache-memory", type=int, help="KV cache size in bytes")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="priority",
        help="priority (default) serves and keeps more important classes first; equal classes are FCFS",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantization",
        choices=QUANT_SCHEMES + CHECKPOINT_METHODS,
        metavar="{" + ",".join(QUANT_SCHEMES) + ",...}",
        help="quantize the weights at load: fp8, w8a16, w4a16, w8a8 or bitsandbytes (NF4); a quantized "
        "checkpoint needs none, and takes its own method or scheme: " + ", ".join(CHECKPOINT_METHODS),
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's element type: auto (the model's dtype), fp8 (E4M3, per-layer scales; fp8_e4m3 is "
        "the same) or fp8_e5m2 (E5M2, the same scales; less precise)",
    )
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method",
        choices=["draft", "ngram"],
        help="propose tokens with a draft model or by n-gram prompt lookup (default: draft if --draft-model)",
    )
    spec.add_argument("--draft-model", help="draft checkpoint directory (same tokenizer as --model)")
    # Unset (None) here, so that one given without a proposer that uses it is refused (EngineConfig).
    spec.add_argument(
        "--num-speculative-tokens", type=int, help="the most tokens proposed per step (K; default 4)"
    )
    spec.add_argument("--ngram-min", type=int, help="n-gram lookup: shortest suffix matched (default 2)")
    spec.add_argument("--ngram-max", type=int, help="n-gram lookup: longest suffix matched (default 4)")
    spec.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        help="turn speculation off (per batch size) or K down (per request) where it does not pay (default on)",
    )
    par = p.add_argument_group("tensor parallelism")
    par.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model across this many ranks (one per GPU; all nodes together)",
    )
    par.add_argument("--nnodes", type=int, default=1, help="nodes the ranks are spread over")
    par.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index: 0 serves the API; the others only run their ranks",
    )
    par.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="with --nnodes > 1: where node 0 listens for the others (0.0.0.0: every interface), and "
        "where the others connect",
    )
    par.add_argument("--master-port", type=int, default=29500, help="with --nnodes > 1: the port of it")
    p.add_argument(
        "--drain-timeout",
        type=arg_types.seconds,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM",
    )
    p.add_argument(
        "--log-interval",
        type=arg_types.log_interval,
        default=5.0,
        help="seconds between load log lines while busy; 0 turns them off (default 5)",
    )
    p.add_argument(
        "--responses-store",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="keep the last N /v1/responses answers in memory, for previous_response_id and GET (default 0: none)",
    )
    p.add_argument(
        "--responses-store-bytes",
        type=arg_types.byte_size,
        default=256 << 20,
        help="and fewer where together, as JSON text, they would pass this many bytes (default 256 MiB)",
    )
    arg_types.add_lora_arguments(p)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--max-request-body-bytes",
        type=arg_types.byte_size,
        default=16 << 20,
        help="larger request bodies are refused with 413 before they are read (default 16 MiB)",
    )


def engine_config(args: argparse.Namespace):  # -> EngineConfig
    """The engine's options, each from the flag of its name."""
    from dataclasses import fields

    from ember_engine.core.config import EngineConfig

    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    given["lora_modules"] = dict(args.lora_modules) if args.lora_modules else None
    return EngineConfig(**given)


def build_server(args: argparse.Namespace):  # -> tuple[DrainingServer, ServerState, list[BaseException]]
    """The server, its state, and a list that receives the error if the model fails to load or the engine
    stops for good (a tensor-parallel rank is lost)."""
    import httpx
    import uvicorn

    from ember_engine.async_engine import AsyncEngine
    from ember_engine.core.llm_engine import LLMEngine
    from ember_engine.server.api_server import build_app
    from ember_engine.server.draining import DrainingServer
    from ember_engine.server.fallback import Fallback
    from ember_engine.server.metrics import EngineMetrics
    from ember_engine.server.policy import PolicyWatcher
    from ember_engine.server.state import ServerState
    from ember_engine.server.warmup import warm_up

    name, *aliases = arg_types.served_names(args)
    policy = PolicyWatcher(args.policy)
    config = engine_config(args)
    loras = config.lora_modules or {}
    takes_loras = bool(loras) or args.allow_runtime_lora_updates
    spec = config.speculative_tokens if config.speculation else 0
    metrics = EngineMetrics(name, spec, len(loras) if takes_loras else None, config.max_loras)
    fallback = Fallback(httpx.AsyncClient(headers=api_keys.fallback_headers()))
    state = ServerState(name, policy, metrics, fallback, loras=dict(loras), aliases=tuple(aliases))
    state.lora_updates = args.allow_runtime_lora_updates
    if args.responses_store:
        from ember_engine.server.responses_api import ResponseStore

        state.responses = ResponseStore(args.responses_store, args.responses_store_bytes)
    failure: list[BaseException] = []
    stopped = threading.Event()  # the server stopped before the model was ready: load() drops its engine
    publish = threading.Lock()

    def stop_for_good(error: BaseException) -> None:
        failure.append(error)
        server.should_exit = True

    def load() -> None:
        start = time.perf_counter()
        engine = LLMEngine(config)
        if args.chat_template is not None:
            engine.tokenizer.use_chat_template(args.chat_template)
        state.metrics.set_cache_config(
            block_size=config.block_size,
            num_gpu_blocks=engine.block_manager.num_blocks,
            cache_dtype=config.kv_cache_dtype,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        state.sampling_defaults = generation_defaults.of_args(args, engine.config.model)
        warm_up(engine)
        with publish:
            if stopped.is_set() or state.draining:  # a SIGTERM came during the load: the pod is going
                engine.shutdown()
                return
            ae = AsyncEngine(engine=engine)
            ae.add_step_hook(state.observe_step)
            ae.add_fatal_hook(stop_for_good)
            state.engine = ae
            log.info("model %s loaded and warmed up in %.1f s; ready", name, time.perf_counter() - start)

    @contextlib.asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        async def loader() -> None:
            loaded: concurrent.futures.Future[None] = concurrent.futures.Future()

            def run() -> None:  # a daemon thread: a stop during a long load need not wait for its end
                if not loaded.set_running_or_notify_cancel():
                    return
                try:
                    load()
                except BaseException as exc:
                    loaded.set_exception(exc)
                else:
                    loaded.set_result(None)
                    # Tensor-parallel workers started here die with the thread that started them (their
                    # parent-death signal follows the thread), so it stays until the process ends.
                    threading.Event().wait()

            threading.Thread(target=run, name="ember-load", daemon=True).start()
            try:
                await asyncio.wrap_future(loaded)
            except asyncio.CancelledError:  # the server stops (a signal) before the model is ready
                with publish:
                    stopped.set()
                raise
            except BaseException as exc:  # a model that cannot load ends the process (the pod restarts)
                if isinstance(exc, (ValueError, OSError)):  # what was given is refused: its message says why
                    log.error("loading %s failed: %s: %s", args.model, type(exc).__name__, exc)
                    log.debug("where loading %s failed", args.model, exc_info=exc)
                else:  # a fault: where it happened
                    log.exception("loading %s failed", args.model)
                failure.append(exc)
                server.should_exit = True

        async def log_load() -> None:
            while True:
                await asyncio.sleep(args.log_interval)
                line = state.metrics.log_line()
                if line:
                    log.info(line)

        tasks = [asyncio.create_task(loader()), asyncio.create_task(policy.run(1.0))]
        if args.log_interval > 0:
            tasks.append(asyncio.create_task(log_load()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.fallback.client.aclose()

    app = build_app(state, args.max_request_body_bytes, api_keys.ApiKeys(api_keys.given_keys(args.api_key)))
    app.router.lifespan_context = lifespan
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=1,
        access_log=False,
    )
    server = DrainingServer(uv_config, state, args.drain_timeout)
    return server, state, failure


def main(args: argparse.Namespace) -> int:
    from ember_engine.server.policy import PolicyError

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.node_rank > 0:
        return run_worker_node(args)
    keys = api_keys.given_keys(args.api_key)
    if problem := arg_types.lora_problem(args, arg_types.served_names(args)) or api_keys.key_problem(keys):
        print(f"ember serve: {problem}", file=sys.stderr)
        return 2
    try:
        server, state, failure = build_server(args)
    except PolicyError as exc:
        print(f"ember serve: invalid policy file {args.policy}: {exc}", file=sys.stderr)
        return 2
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    if failure:
        # The last line of the log: a pod's termination message (FallbackToLogsOnError) is the log's tail,
        # and the operator reports its last line, so it must say what failed.
        error = failure[0]
        what = "the engine stopped" if state.engine is not None else "cannot load the model"
        print(f"ember serve: fatal: {what}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    if state.engine is None:  # a stop (SIGTERM when a pod is deleted) during the load is no failure
        print("ember serve: stopped before the model was ready", file=sys.stderr, flush=True)
        _leave_the_load(0)
    return 0


def _leave_the_load(code: int) -> None:
    """End the process while its load thread may still be inside torch. The interpreter's own exit would
    stop that daemon thread where it next takes the GIL, and a thread stopped so inside a native frame aborts
    the whole process (SIGABRT, "terminate called without an active exception"); the load has nothing to
    save, so the process ends here, its logs flushed."""
    if not any(t.name == "ember-load" and t.is_alive() for t in threading.enumerate()):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker_node(args: argparse.Namespace) -> int:
    """A node other than 0 of a multi-node group: its ranks only, until node 0 stops them."""
    from ember_engine.distributed.group import TensorParallelFailure
    from ember_engine.distributed.workers import run_node

    config = engine_config(args)
    try:
        config.validate()
        run_node(config)
    except (TensorParallelFailure, ValueError) as exc:
        print(f"ember serve: fatal: node {args.node_rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
