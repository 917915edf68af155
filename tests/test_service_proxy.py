"""The service proxy against the in-process API server and the process kubelet: the published address,
round robin over Ready pods, unready and missing endpoints, and deleted Services. (The engine behind a
Service, streaming included, is in test_kubelet.py.)"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.kubelet.kubelet import ProcessKubelet
from ember_localcluster.proxy import ServiceProxy
from ember_localcluster.scheduler import Scheduler

T = TypeVar("T")

PYTHON_IMAGE = "docker.io/library/python:3.11-slim"


@dataclass
class Cluster:
    api: APIServer
    proxy: ServiceProxy
    root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("proxy")
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1) as api:
        kubeconfig = api.write_kubeconfig(root / "kubeconfig")
        kubelet = ProcessKubelet(
            kubeconfig, root / "state", images={"docker.io/library/python": ("python3",)}
        )
        with Scheduler(kubeconfig), kubelet, ServiceProxy(kubeconfig) as proxy:
            yield Cluster(api, proxy, root)


def is_ready(api: APIServer, name: str) -> bool:
    pod = api.get("v1", "Pod", "default", name) or {}
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def web_pod(name: str, root: Path, app: str) -> dict[str, Any]:
    """`python -m http.server` on port 8080 of the pod's own address, serving `root/name/`."""
    www = root / name
    www.mkdir(exist_ok=True)
    (www / "who.txt").write_text(name)
    command = ["python", "-m", "http.server", "--bind", "0.0.0.0", "--directory", "/www", "8080"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "web",
                    "image": PYTHON_IMAGE,
                    "command": command,
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "volumeMounts": [{"name": "www", "mountPath": "/www"}],
                    "readinessProbe": {"httpGet": {"path": "/who.txt", "port": "http"}, "periodSeconds": 1},
                }
            ],
            "volumes": [{"name": "www", "hostPath": {"path": str(www)}}],
        },
    }


def service(name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }


def published_port(api: APIServer, name: str) -> int | None:
    svc = api.get("v1", "Service", "default", name) or {}
    ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    if not ingress:
        return None
    assert ingress[0]["ip"] == "127.0.0.1" and ingress[0]["ports"][0]["protocol"] == "TCP"
    return int(ingress[0]["ports"][0]["port"])


def who(port: int) -> str:
    # A new connection each time (http.server speaks HTTP/1.0): round robin is per connection.
    return httpx.get(f"http://127.0.0.1:{port}/who.txt", trust_env=False, timeout=10).text


@pytest.fixture(scope="module")
def round_robin(cluster: Cluster) -> int:
    """Two Ready pods `rr-a` and `rr-b` behind the Service `rr`; its local port."""
    api = cluster.api
    for name in ("rr-a", "rr-b"):
        api.create(web_pod(name, cluster.root, "rr"))
    api.create(service("rr", {"app": "rr"}))
    for name in ("rr-a", "rr-b"):
        wait_for(lambda name=name: is_ready(api, name), what=f"{name} to be Ready")
    port = wait_for(lambda: published_port(api, "rr"), what="the address of Service rr")
    # The proxy's watch of the pods can lag the API (as kube-proxy's endpoints do): until it sees both
    # Ready, a connection is closed unanswered or reaches one pod only.
    wait_for(
        lambda: {routed(port) for _ in range(4)} == {"rr-a", "rr-b"}, what="Service rr to route to both pods"
    )
    return port


def routed(port: int) -> str | None:
    """The pod that answers a new connection, or None where the proxy closed it without an answer."""
    try:
        return who(port)
    except httpx.TransportError:
        return None


def test_address_is_published_in_the_service_status(cluster: Cluster, round_robin: int) -> None:
    assert cluster.proxy.address("default", "rr") == ("127.0.0.1", round_robin)
    assert cluster.proxy.address("default", "rr", 80) == ("127.0.0.1", round_robin)
    assert cluster.proxy.address("default", "rr", 81) is None


def test_connections_round_robin_over_ready_pods(round_robin: int) -> None:
    answers = [who(round_robin) for _ in range(6)]
    assert set(answers) == {"rr-a", "rr-b"}
    assert all(a != b for a, b in itertools.pairwise(answers)), answers


def test_unready_pod_gets_no_connections(cluster: Cluster, round_robin: int) -> None:
    api, probed = cluster.api, cluster.root / "rr-b" / "who.txt"
    probed.unlink()
    try:
        wait_for(lambda: not is_ready(api, "rr-b"), what="rr-b to turn unready")
        assert [who(round_robin) for _ in range(4)] == ["rr-a"] * 4
    finally:
        probed.write_text("rr-b")
    wait_for(lambda: is_ready(api, "rr-b"), what="rr-b to be Ready again")
    assert {who(round_robin) for _ in range(4)} == {"rr-a", "rr-b"}


def test_service_without_ready_endpoints_closes_connections(cluster: Cluster) -> None:
    cluster.api.create(service("nobody", {"app": "nothing-matches"}))
    port = wait_for(lambda: published_port(cluster.api, "nobody"), what="the address of Service nobody")
    # Closed without a byte: to an HTTP client, the Service answered nothing.
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.get(f"http://127.0.0.1:{port}/", trust_env=False, timeout=10)


def test_deleted_service_closes_its_listener(cluster: Cluster, round_robin: int) -> None:
    api = cluster.api
    api.create(service("short-lived", {"app": "rr"}))
    port = wait_for(lambda: published_port(api, "short-lived"), what="the address of Service short-lived")
    assert port != round_robin and who(port) in ("rr-a", "rr-b")
    api.delete("v1", "Service", "default", "short-lived")
    wait_for(
        lambda: cluster.proxy.address("default", "short-lived") is None,
        what="the listener to close",
        timeout=10,
    )

    def refused() -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", trust_env=False, timeout=2)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        return False

    wait_for(refused, what="connections to be refused", timeout=10)


# Sends one line, then the second only once the file named by argv[3] exists.
TWO_PART_SERVER = """
import os, socket, sys, threading, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
def serve(conn):
    with conn:
        conn.sendall(b"first\\n")
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.05)
        conn.sendall(b"second\\n")
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""


def test_bytes_pass_through_as_they_arrive(cluster: Cluster) -> None:
    api, shared = cluster.api, cluster.root / "two-part"
    shared.mkdir()
    pod = web_pod("two-part", cluster.root, "two-part")
    pod["spec"]["containers"][0].update(
        command=["python", "-c", TWO_PART_SERVER, "0.0.0.0", "9000", "/www/go"],
        ports=[{"name": "stream", "containerPort": 9000}],
        readinessProbe={"tcpSocket": {"port": "stream"}, "periodSeconds": 1},
    )
    api.create(pod)
    svc = service("two-part", {"app": "two-part"})
    svc["spec"]["ports"] = [{"port": 9000, "targetPort": "stream"}]
    api.create(svc)
    wait_for(lambda: is_ready(api, "two-part"), what="two-part to be Ready")
    port = wait_for(lambda: published_port(api, "two-part"), what="the address of Service two-part")

    def first_line() -> tuple[socket.socket, Any] | None:
        """A connection whose first line has arrived, or None where the proxy closed it without a byte: its
        watch of the pods can lag the API, as kube-proxy's endpoints do, and a client retries."""
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        stream = sock.makefile("rb")
        line = stream.readline()  # a buffering proxy would hold it: the read times out and the test fails
        if line == b"first\n":
            return sock, stream
        stream.close()
        sock.close()
        if line:  # not an AssertionError: wait_for would take it for "not yet"
            raise RuntimeError(f"the first line came back as {line!r}")
        return None

    # The upstream is still holding back its second line: the first must already be here.
    sock, stream = wait_for(first_line, what="the Service to route a connection to two-part")
    with sock, stream:
        (shared / "go").touch()
        assert stream.readline() == b"second\n"
