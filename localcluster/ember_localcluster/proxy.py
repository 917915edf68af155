"""The local control plane's service proxy: a local TCP address for every Service, like a load balancer.

`ServiceProxy` watches Services and Pods through the official `kubernetes` client. For each TCP port of
each Service it opens a listener on 127.0.0.1 (an ephemeral port) and publishes it as the Service's
load-balancer address through `services/status`:

    status.loadBalancer.ingress: [{ip: 127.0.0.1, ports: [{port: <local port>, protocol: TCP}, ...]}]

with one entry in `ports` per TCP port of `spec.ports`, in the same order (`address()` gives the same
from Python). Each accepted connection goes to one endpoint: a pod in the Service's namespace whose
labels match `spec.selector`, whose Ready condition is True, which is not being deleted and has a
`podIP`; the port is `targetPort` (a number, or a container port's name looked up in the pod's spec;
absent means `port`). Endpoints are taken round robin per listener, in pod-name order, and a refused or
timed-out connect moves on to the next one. The bytes are spliced both ways as they arrive (half-closes
passed on), so streamed responses such as server-sent events pass through unbuffered.

A connection that finds no Ready endpoint, or none that accepts, is closed without a byte: to an HTTP
client the Service answers nothing, as a Service without endpoints refuses in Kubernetes (it is reported
as a connection error, which clients such as `openai` retry). A deleted Service's listeners are closed;
connections already spliced run on until either side closes.

Not modelled: cluster IPs and node ports (there is only the published local address), DNS, UDP and SCTP
ports, Endpoints/EndpointSlices objects (Services without a selector get a listener but never an
endpoint), session affinity, traffic policies, topology, terminating endpoints as fallbacks, and headless
and ExternalName Services (no listener). Round robin is per connection: a kept-alive HTTP connection
stays with its endpoint, as with kube-proxy. A stopped proxy leaves the published addresses in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from ember_localcluster.informer import API_TIMEOUT, MERGE_PATCH
from ember_localcluster.runtime import BackgroundRuntime

log = logging.getLogger("ember.proxy")

CHUNK = 64 * 1024


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return (meta.get("namespace") or "", meta["name"])


def _is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _target_port(pod: dict[str, Any], target: Any) -> int | None:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target and port.get("protocol", "TCP") == "TCP":
                return int(port["containerPort"])
    return None


@dataclass(slots=True, eq=False)
class _Listener:
    service: tuple[str, str]
    target: Any  # its targetPort: a number or a container port's name
    server: asyncio.Server
    local_port: int
    turn: int = 0


class ServiceProxy:
    """Local listeners for the Services of the API server at `kubeconfig` (see the module docstring).

    `host` is the address listeners bind and publish; `connect_timeout` bounds each attempt to reach an
    endpoint. `start()` returns once the Services and Pods have been listed and their listeners opened.
    """

    def __init__(
        self, kubeconfig: str | Path, *, host: str = "127.0.0.1", connect_timeout: float = 2.0
    ) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.host = host
        self.connect_timeout = connect_timeout
        self._services: dict[tuple[str, str], dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._listeners: dict[tuple[str, str], dict[int, _Listener]] = {}
        # (namespace, name) → Service port → local port; replaced whole, so other threads may read it.
        self._addresses: dict[tuple[str, str], dict[int, int]] = {}
        self._reconciling: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._connections: set[asyncio.Task[None]] = set()
        self._runtime = BackgroundRuntime("proxy", api_workers=2)

    # -- public ----------------------------------------------------------------------------------------

    def __enter__(self) -> ServiceProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def address(self, namespace: str, name: str, port: int | None = None) -> tuple[str, int] | None:
        """(host, local port) serving the Service's `port` (default: its first), or None."""
        ports = self._addresses.get((namespace, name)) or {}
        if port is None:
            port = next(iter(ports), None)
        local = ports.get(port) if port is not None else None
        return (self.host, local) if local is not None else None

    def start(self) -> ServiceProxy:
        runtime = self._runtime
        if runtime.running:
            raise RuntimeError("the service proxy is already running")
        runtime.start(self.kubeconfig)
        pods = runtime.informer(runtime.core.list_pod_for_all_namespaces, self._on_pod, name="proxy-pods")
        services = runtime.informer(
            runtime.core.list_service_for_all_namespaces, self._on_service, name="proxy-services"
        )
        runtime.sync(pods, services)
        # Wait for the listeners of the Services listed so far.
        runtime.run(self._settled(), timeout=30)
        return self

    def stop(self) -> None:
        self._runtime.stop(self._shutdown)

    # -- state, on the proxy's loop --------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._pods.pop(_key(pod), None)
        else:
            self._pods[_key(pod)] = pod

    def _on_service(self, kind: str, service: dict[str, Any]) -> None:
        key = _key(service)
        if kind == "DELETED":
            self._services.pop(key, None)
        else:
            self._services[key] = service
        # One reconciliation per Service at a time; the latest state wins.
        previous = self._reconciling.get(key)
        task = asyncio.get_running_loop().create_task(self._reconcile(key, previous))
        self._reconciling[key] = task
        task.add_done_callback(functools.partial(self._reconciled, key))

    def _reconciled(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._reconciling.get(key) is task:
            del self._reconciling[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("service %s/%s: reconciling failed", *key, exc_info=task.exception())

    async def _settled(self) -> None:
        while self._reconciling:
            await asyncio.gather(*self._reconciling.values(), return_exceptions=True)

    async def _reconcile(self, key: tuple[str, str], previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        service = self._services.get(key)
        wanted = self._wanted_ports(service) if service is not None else {}
        listeners = self._listeners.setdefault(key, {})
        for port in [p for p in listeners if p not in wanted]:
            listeners.pop(port).server.close()
        for port, target in wanted.items():
            if port in listeners:
                listeners[port].target = target
            else:
                listeners[port] = await self._listen(key, port, target)
        if not listeners:
            self._listeners.pop(key, None)
        addresses = {k: v for k, v in self._addresses.items() if k != key}
        if wanted:
            addresses[key] = {p: listeners[p].local_port for p in wanted}
        self._addresses = addresses
        if service is not None:
            await self._publish(service, [listeners[p].local_port for p in wanted])

    @staticmethod
    def _wanted_ports(service: dict[str, Any]) -> dict[int, Any]:
        spec = service.get("spec") or {}
        if spec.get("type") == "ExternalName" or spec.get("clusterIP") == "None":
            return {}
        return {
            int(p["port"]): p.get("targetPort", p["port"])
            for p in spec.get("ports") or []
            if p.get("protocol", "TCP") == "TCP"
        }

    async def _listen(self, key: tuple[str, str], port: int, target: Any) -> _Listener:
        holder: list[_Listener] = []

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._connections.add(task)
            try:
                await self._forward(holder[0], reader, writer)
            except asyncio.CancelledError:
                # Cancelled by stop(): returning (not re-raising) keeps asyncio's stream callback quiet.
                writer.transport.abort()
            finally:
                self._connections.discard(task)

        server = await asyncio.start_server(accept, self.host, 0)
        local_port = int(server.sockets[0].getsockname()[1])
        listener = _Listener(key, target, server, local_port)
        holder.append(listener)
        log.info("service %s/%s port %d: listening on %s:%d", *key, port, self.host, local_port)
        return listener

    async def _publish(self, service: dict[str, Any], local_ports: list[int]) -> None:
        ingress = (
            [{"ip": self.host, "ports": [{"port": p, "protocol": "TCP"} for p in local_ports]}]
            if local_ports
            else None
        )
        current = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress")
        if current == ingress:
            return
        namespace, name = _key(service)
        call = functools.partial(
            self._runtime.core.patch_namespaced_service_status,
            name,
            namespace,
            {"status": {"loadBalancer": {"ingress": ingress}}},
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=API_TIMEOUT,
        )
        try:
            await asyncio.get_running_loop().run_in_executor(self._runtime.executor, call)
        except ApiException as error:
            if error.status != 404:  # 404: deleted meanwhile
                log.warning("service %s/%s: publishing the address failed: %s", namespace, name, error)
        except (
            OSError,
            urllib3.exceptions.HTTPError,
        ) as error:  # unreachable; the Service's next event retries
            log.warning("service %s/%s: publishing the address failed: %s", namespace, name, error)

    # -- connections -----------------------------------------------------------------------------------

    def _endpoints(self, listener: _Listener) -> list[tuple[str, int]]:
        service = self._services.get(listener.service)
        selector = ((service or {}).get("spec") or {}).get("selector") or {}
        if not selector:
            return []
        namespace = listener.service[0]
        endpoints = []
        for (pod_namespace, _), pod in sorted(self._pods.items()):
            labels = pod["metadata"].get("labels") or {}
            ip = (pod.get("status") or {}).get("podIP")
            if (
                pod_namespace != namespace
                or any(labels.get(k) != v for k, v in selector.items())
                or pod["metadata"].get("deletionTimestamp")
                or not ip
                or not _is_ready(pod)
            ):
                continue
            port = _target_port(pod, listener.target)
            if port is not None:
                endpoints.append((ip, port))
        return endpoints

    async def _connect(self, listener: _Listener) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        endpoints = self._endpoints(listener)
        first = listener.turn
        listener.turn += 1
        for i in range(len(endpoints)):
            host, port = endpoints[(first + i) % len(endpoints)]
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
            except (OSError, TimeoutError) as error:
                log.info("service %s/%s: endpoint %s:%d failed: %s", *listener.service, host, port, error)
        return None

    async def _forward(
        self, listener: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        upstream = await self._connect(listener)
        if upstream is None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        up_reader, up_writer = upstream
        writers = (writer, up_writer)
        try:
            await asyncio.gather(_pipe(reader, up_writer, writers), _pipe(up_reader, writer, writers))
        finally:
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(OSError):
                    await w.wait_closed()

    async def _shutdown(self) -> None:
        for listeners in self._listeners.values():
            for listener in listeners.values():
                listener.server.close()
        self._listeners.clear()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, *self._reconciling.values(), return_exceptions=True)


async def _pipe(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, both: tuple[asyncio.StreamWriter, ...]
) -> None:
    """Copy until end of stream, then half-close; on a broken connection, drop both at once."""
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except OSError:
        for writer in both:
            writer.transport.abort()
