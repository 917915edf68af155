"""Joining a tensor-parallel group: the rendezvous (a TCP store that rank 0 serves) and two process groups.

The compute group carries the layers' all-reduces and the logits gather: `nccl` on GPUs, `gloo` on CPU.
The control group (always `gloo`, on the CPU) carries rank 0's per-step message; it waits without a time
limit, because workers wait on it for as long as the engine is idle. A dead peer still ends every wait at
once: gloo fails a collective as soon as a peer's connection closes.

Rank 0 listens for the rendezvous on a socket it binds itself, at `master_addr:master_port` (port 0: any
free port, for a group on one machine), so two groups on one host never compete for a port.

Before the process groups form, every other rank publishes its node's identity (options and checkpoint,
`agreement.node_identity`) in the store as it arrives; rank 0 compares each with its own as it comes and
publishes the verdict, which every rank reads before joining: a node started otherwise is refused on every
node, naming what differs, before any model loads or collective runs.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ember_engine.distributed.agreement import disagreement
from ember_engine.model.parallel import TPGroup

log = logging.getLogger(__name__)

# A collective waiting longer than this on the compute group means a rank hangs: it fails, and the engine
# with it, rather than hanging for ever.
COMPUTE_TIMEOUT = datetime.timedelta(minutes=10)
IDLE_FOREVER = datetime.timedelta(days=365)
# How long ranks of other nodes keep trying to reach rank 0 (its pod may start later than theirs).
CONNECT_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallelFailure(RuntimeError):
    """A rank of the group is gone (or the group cannot form): the engine cannot go on."""


class NodesDisagree(TensorParallelFailure, ValueError):
    """A node was started with other options or another checkpoint than node 0's: a refusal of what was
    given (a ValueError), which also ends the group."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    master_addr: str
    master_port: int
    world_size: int


@dataclass(slots=True)
class Membership:
    """This process's rank in a formed group, with what it needs to leave it."""

    tp: TPGroup
    control: Any  # the gloo group of the step messages
    device: torch.device
    store: dist.Store  # on rank 0 it also serves the rendezvous: it lives as long as the group

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_rendezvous(addr: str, port: int, world_size: int) -> tuple[dist.TCPStore, int]:
    """Rank 0's store, served on a socket bound here to `addr:port` (port 0: a free one); returns it
    with the port, to hand to the workers. The store owns the socket from then on."""
    listener = socket.create_server((addr, port))
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=True,
        timeout=CONNECT_TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, port


def connect_rendezvous(rendezvous: Rendezvous, node: int, identity: dict[str, Any]) -> dist.TCPStore:
    """Another rank's client of rank 0's store; it keeps trying to connect for CONNECT_TIMEOUT. The rank
    publishes its node's identity, then counts itself arrived."""
    store = dist.TCPStore(
        _resolve(rendezvous.master_addr),
        rendezvous.master_port,
        rendezvous.world_size,
        is_master=False,
        timeout=CONNECT_TIMEOUT,
    )
    index = store.add(IDENTITIES, 1)
    store.set(f"{IDENTITIES}/{index}", json.dumps([node, identity]))
    store.add(ARRIVED, 1)
    return store


def check_arrivals(store: dist.Store, identity: dict[str, Any], first: int, last: int) -> None:
    """Rank 0: compare the identities of arrivals `first`..`last` (from 1) with node 0's. A difference
    becomes the verdict every rank reads (`join`), and is raised here."""
    arrivals = [json.loads(store.get(f"{IDENTITIES}/{n}")) for n in range(first, last + 1)]
    message = disagreement([(0, identity), *((int(node), other) for node, other in arrivals)])
    if message is not None:
        store.set(VERDICT, message)
        raise NodesDisagree(message)


def join(
    store: dist.Store,
    rank: int,
    world_size: int,
    local_rank: int,
    device_type: str,
) -> Membership:
    """Form the group (every rank calls this); returns once all `world_size` ranks have joined. Rank 0
    calls it once every other rank has arrived and agreed (`check_arrivals`); the others first read
    its verdict, and raise NodesDisagree when some node differs."""
    if rank == 0:
        store.set(VERDICT, "")
    elif verdict := store.get(VERDICT).decode():
        raise NodesDisagree(verdict)
    if dist.is_initialized():
        raise TensorParallelFailure(
            "this process already belongs to a tensor-parallel group: one tensor-parallel engine per process"
        )
    device = torch.device("cpu")
    backend = "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COMPUTE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
    log.info("rank %d of %d joined the tensor-parallel group (%s on %s)", rank, world_size, backend, device)
    return Membership(TPGroup(rank, world_size), control, device, store)


def arrived(store: dist.Store) -> int:
    """How many ranks other than 0 have connected to the rendezvous so far."""
    return int(store.add(ARRIVED, 0))


ARRIVED = "ember/arrived"
IDENTITIES = "ember/identities"  # the count of identities published; each under IDENTITIES/<n>
VERDICT = "ember/verdict"  # rank 0's: "" when every node agrees, else what differs


def _resolve(host: str) -> str:
    """Rank 0's address; its DNS name may appear only after this pod starts, so keep asking a while."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while True:
        try:
            return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise TensorParallelFailure(f"cannot resolve the rendezvous address {host!r}: {exc}") from exc
            time.sleep(1.0)
