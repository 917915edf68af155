"""The ranks other than 0: processes the engine starts (spawn) on its own node, and the loop they run.

Rank 0 (the engine's process: scheduler, sampling, the HTTP server) starts ranks 1..n-1 of its node and
joins the group with them; on other nodes `ember serve --node-rank K` starts that node's ranks. A worker
builds the same `ModelRunner` over its shard, then runs whatever chunks rank 0 broadcasts until told to
stop. Death anywhere ends the group: a worker that exits is seen by rank 0's watchdog at once (even while
idle) and by any collective in flight; a worker whose rank 0 is gone fails its next receive and exits, and
the kernel kills it if its parent process dies first.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ember_engine.core.config import EngineConfig
from ember_engine.distributed.agreement import node_identity
from ember_engine.distributed.group import (
    CONNECT_TIMEOUT,
    Membership,
    NodesDisagree,
    Rendezvous,
    TensorParallelFailure,
    arrived,
    check_arrivals,
    connect_rendezvous,
    join,
    serve_rendezvous,
)
from ember_engine.distributed.step_channel import StepChannel
from ember_engine.model.model_config import ModelConfig
from ember_engine.model.model_runner import Chunk, ModelRunner
from ember_engine.model.parallel import TPGroup

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def device_type(config: EngineConfig) -> str:
    if config.device != "auto":
        return torch.device(config.device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_runner(config: EngineConfig, membership: Membership, **options: Any) -> ModelRunner:
    """The target model's runner for this rank: every rank builds it the same way, in step."""
    model_config = ModelConfig.from_dir(config.model)
    max_model_len = model_config.max_model_len(config.max_model_len)
    return ModelRunner(
        config, model_config, max_model_len, tp=membership.tp, device=membership.device, **options
    )


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so no rank outlives it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _spawned_worker(
    config: EngineConfig, rendezvous: Rendezvous, rank: int, local_rank: int, local_size: int
) -> None:
    _die_with_parent()
    try:
        worker_main(config, rendezvous, rank, local_rank, local_size)
    except NodesDisagree as exc:  # the node's first rank reports it; this one only exits
        log.error("rank %d: %s", rank, exc)
        sys.exit(1)


def spawn_ranks(
    config: EngineConfig, rendezvous: Rendezvous, first: int, local_size: int
) -> list[multiprocessing.process.BaseProcess]:
    """Start a node's ranks after its first (`first` is the node's first global rank, run by the caller)."""
    ctx = multiprocessing.get_context("spawn")
    processes: list[multiprocessing.process.BaseProcess] = [
        ctx.Process(
            target=_spawned_worker,
            args=(config, rendezvous, first + i, i, local_size),
            name=f"ember-tp-rank{first + i}",
            daemon=True,
        )
        for i in range(1, local_size)
    ]
    for p in processes:
        p.start()
    return processes


def worker_main(
    config: EngineConfig, rendezvous: Rendezvous, rank: int, local_rank: int, local_size: int
) -> None:
    """A worker rank: join (once node 0 has agreed to this node's options and checkpoint), load this
    rank's shard, run rank 0's steps until it says stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    kind = device_type(config)
    if kind == "cpu":  # the node's cores are shared by its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    store = connect_rendezvous(rendezvous, config.node_rank, node_identity(config, kind))
    membership = join(store, rank, rendezvous.world_size, local_rank, kind)
    try:
        runner = build_runner(config, membership)
        serve_steps(runner, StepChannel(membership.control))
    finally:
        membership.leave()


@torch.inference_mode()
def serve_steps(runner: ModelRunner, channel: StepChannel) -> None:
    while True:
        chunks = channel.receive()
        if chunks is None:
            return
        if chunks:  # none: rank 0's heartbeat while idle
            runner.run(chunks)


class WorkerPool:
    """Rank 0's view of the group: its local worker processes, the step channel and a watchdog."""

    def __init__(
        self, membership: Membership, processes: Sequence[multiprocessing.process.BaseProcess]
    ) -> None:
        self.membership = membership
        self.processes = list(processes)
        self.channel = StepChannel(membership.control)
        self.lost: TensorParallelFailure | None = None
        self.on_lost: Callable[[TensorParallelFailure], None] | None = None
        self._stopping = False
        self._watchdog = threading.Thread(target=self._watch, name="ember-tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.stop)

    @classmethod
    def start(cls, config: EngineConfig) -> WorkerPool:
        """Start this node's other ranks and form the group with every node's (rank 0 is this process)."""
        size = config.tensor_parallel_size
        local_size = size // config.nnodes
        single = config.nnodes == 1
        addr = "127.0.0.1" if single else config.master_addr
        store, port = serve_rendezvous(addr, 0 if single else config.master_port, size)
        # This node's workers reach the store locally, whatever interface it listens on.
        rendezvous = Rendezvous("127.0.0.1" if addr in ("0.0.0.0", "::") else addr, port, size)
        processes = spawn_ranks(config, rendezvous, 0, local_size)
        try:
            wait_for_ranks(store, size, processes, node_identity(config, device_type(config)))
            membership = join(store, 0, size, 0, device_type(config))
        except BaseException:
            stop_processes(processes, grace=0.0)
            raise
        return cls(membership, processes)

    @property
    def tp(self) -> TPGroup:
        return self.membership.tp

    def send(self, chunks: Sequence[Chunk]) -> None:
        self.channel.send(chunks)

    def heartbeat(self) -> None:
        """While idle: an empty step message, which fails once a rank's connection has closed (a rank on
        another node that died); and a look at the rendezvous, where a rank arriving after the group
        formed is a replacement, its predecessor gone. Raises the TensorParallelFailure."""
        try:
            self.channel.send([])
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        if (count := arrived(self.membership.store)) > self.tp.size - 1:
            raise TensorParallelFailure(
                f"a tensor-parallel rank joined the rendezvous after the group formed ({count + 1} ranks "
                f"of {self.tp.size} arrived): it replaces one that is gone"
            )

    def failure(self, cause: BaseException) -> TensorParallelFailure:
        """What a failed collective means: a named dead worker if one of ours is (given a moment to be
        reaped), else the cause (a rank on another node)."""
        deadline = time.monotonic() + 2.0
        while self.lost is None and time.monotonic() < deadline:
            self._check_processes()
            time.sleep(0.05)
        if self.lost is not None:
            return self.lost
        return TensorParallelFailure(f"the tensor-parallel group failed: {cause}")

    def _check_processes(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if self.lost is None and not p.is_alive():
                self.lost = TensorParallelFailure(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}"
                )

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.processes]
        if not sentinels:
            return
        ended = multiprocessing.connection.wait(sentinels)
        if self._stopping:
            return
        for p in self.processes:
            if p.sentinel in ended:
                p.join(5)  # the pipe closes a moment before the process can be reaped
        self._check_processes()
        if self.lost is not None:
            log.error("%s; the engine cannot go on", self.lost)
            if self.on_lost is not None:
                self.on_lost(self.lost)

    def stop(self, graceful: bool = True) -> None:
        """Tell the workers to stop (graceful: between steps, so they are listening), wait for them,
        leave the group. Safe to call twice."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.stop)
        if graceful and self.lost is None and all(p.is_alive() for p in self.processes):
            with contextlib.suppress(RuntimeError):
                self.channel.send_stop()
        stop_processes(self.processes, grace=10.0 if graceful else 0.0)
        self.membership.leave()


def wait_for_ranks(
    store: dist.Store,
    world_size: int,
    processes: Sequence[multiprocessing.process.BaseProcess],
    identity: dict[str, Any],
) -> None:
    """Rank 0's side of the rendezvous, before joining: wait until every other rank has arrived, checking
    each node's identity against node 0's `identity` as it arrives (NodesDisagree at the first that
    differs), failing at once when a local worker dies on the way (the group would otherwise wait for it
    until timeout)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    checked = 0
    while True:
        count = arrived(store)
        if count > checked:
            check_arrivals(store, identity, checked + 1, count)
            checked = count
        if count >= world_size - 1:
            return
        for rank, p in enumerate(processes, start=1):
            if not p.is_alive():
                p.join(0.1)
                raise TensorParallelFailure(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)} "
                    "before joining the group"
                )
        if time.monotonic() > deadline:
            raise TensorParallelFailure(
                f"only {count + 1} of {world_size} tensor-parallel ranks joined within "
                f"{CONNECT_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(0.05)


def stop_processes(processes: Sequence[multiprocessing.process.BaseProcess], grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def run_node(config: EngineConfig) -> None:
    """`ember serve --node-rank K` for K > 0: this node's ranks (the first in this process, the others
    spawned) until rank 0 stops them. Raises TensorParallelFailure when the group breaks."""
    from ember_engine.model.gguf import directory as gguf_dir

    gguf_dir.describe(config)
    local_size = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * local_size
    rendezvous = Rendezvous(config.master_addr, config.master_port, config.tensor_parallel_size)
    processes = spawn_ranks(config, rendezvous, first, local_size)
    try:
        worker_main(config, rendezvous, first, 0, local_size)
    except NodesDisagree:
        raise
    except RuntimeError as exc:
        raise TensorParallelFailure(f"rank {first} left the tensor-parallel group: {exc}") from exc
    finally:
        stop_processes(processes)
