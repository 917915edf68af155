"""`ember dev up|down|run`: the local control plane as one background process.

`DevCluster` runs, in one process: the in-process API server (with the InferenceService and
LeaderWorkerSet CRDs installed), the deployment and replicaset controllers (the routers' Deployments), the
LeaderWorkerSet controller (multi-node replicas), the node lifecycle and taint eviction controllers
(a node whose Lease is not renewed for `node_monitor_grace_period` goes Unknown and its pods not Ready;
`stop_node`/`start_node` lose a node and bring it back), the disruption controller (PodDisruptionBudgets' status,
which the API server's `pods/eviction` spends, so `kubectl drain` honours them), the scheduler, the process kubelet (registering `nodes` Nodes named `ember-local`, `ember-local-2`, ...,
each with `gpus_per_node` `nvidia.com/gpu`, optional taints, and the host's CPUs and memory unless
`NodeConfig`s say otherwise), the service proxy and the operator (kopf, standalone, all namespaces). The
API server serves `pods/log` (`kubectl logs`) from the kubelet's log files. It writes a kubeconfig for
kubectl into its directory. PersistentVolumeClaim `model-weights` maps to `<dir>/models`, where
`ember dev up` puts a tiny test checkpoint, so `examples/local.yaml` serves out of the box.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ember_localcluster.kubelet.containers import BACKOFF_INITIAL, BACKOFF_MAX
from ember_localcluster.kubelet.node import DEFAULT_GPUS_PER_NODE, NodeConfig, local_nodes, parse_taint
from ember_localcluster.kubelet.nodelease import LEASE_DURATION_SECONDS
from ember_localcluster.nodelifecycle_controller import GRACE_PERIOD, MONITOR_PERIOD
from ember_localcluster.podgc_controller import GC_CHECK_PERIOD

DEFAULT_PROMETHEUS_PORT = 19090

MODEL_CLAIM = "model-weights"
DEFAULT_PORT = 16443
OPERATOR_NAMESPACE = "ember-system"
RUNNING_LOCK = "dev.lock"  # held by the running control plane (`ember dev run`)
COMMANDS_LOCK = "commands.lock"  # held by one `ember dev up` or `down` at a time


class PortInUse(OSError):
    """The API server's port is taken (by another `ember dev`, or anything else)."""

    def __init__(self, port: int, error: OSError) -> None:
        super().__init__(
            error.errno,
            f"cannot listen on 127.0.0.1:{port}: {error.strerror or error}; port {port} is already in use "
            "(by another `ember dev up`, or another program): stop that, or choose a port with --port",
        )


def default_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ember" / "dev"


class DevCluster:
    """The local control plane in this process (see the module docstring).

    `nodes` is how many alike nodes to register (each with `gpus_per_node` GPUs and `taints`, mappings
    with `key`, optional `value` and `effect`), or the `NodeConfig` of each node for full control.
    `backoff_initial`/`backoff_max` shorten the kubelet's crash-loop back-off (for tests; `ember dev` keeps
    the kubelet's, 10 s doubling to 300 s), as `node_lease_seconds` (40), `node_monitor_period` (5 s) and
    `node_monitor_grace_period` (40 s) shorten how long a lost node takes to be noticed, and `pod_gc_period`
    (20 s) how soon the pods of a deleted Node are force-deleted (after two periods).
    """

    def __init__(
        self,
        directory: str | Path,
        port: int = 0,
        tick: float = 1.0,
        *,
        nodes: int | Sequence[NodeConfig] = 1,
        gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
        taints: Sequence[Mapping[str, str]] = (),
        prometheus_port: int | None = None,
        scrape_interval: float = 2.0,
        backoff_initial: float = BACKOFF_INITIAL,
        backoff_max: float = BACKOFF_MAX,
        node_lease_seconds: int = LEASE_DURATION_SECONDS,
        node_monitor_period: float = MONITOR_PERIOD,
        node_monitor_grace_period: float = GRACE_PERIOD,
        pod_gc_period: float = GC_CHECK_PERIOD,
    ) -> None:
        self.dir = Path(directory).resolve()
        self.port = port
        self.tick = tick
        self.nodes: list[NodeConfig] = (
            local_nodes(nodes, gpus_per_node, taints=taints) if isinstance(nodes, int) else list(nodes)
        )
        self.api: Any = None
        self.scheduler: Any = None
        self.leaderworkersets: Any = None
        self.deployments: Any = None
        self.disruption: Any = None
        self.kubelet: Any = None
        self.proxy: Any = None
        self.prometheus_port = prometheus_port
        self.scrape_interval = scrape_interval
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.node_lease_seconds = node_lease_seconds
        self.node_monitor_period, self.node_monitor_grace_period = (
            node_monitor_period,
            node_monitor_grace_period,
        )
        self.nodelifecycle: Any = None
        self.pod_gc_period = pod_gc_period
        self.podgc: Any = None
        self.tainteviction: Any = None
        self.prometheus: Any = None
        self._metrics_server: Any = None
        self._operator: threading.Thread | None = None
        self._stop_operator = threading.Event()
        self.operator_error: BaseException | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> DevCluster:
        from ember_localcluster.apiserver import APIServer
        from ember_localcluster.deployment_controller import DeploymentController
        from ember_localcluster.disruption_controller import DisruptionController
        from ember_localcluster.kubelet.kubelet import ProcessKubelet
        from ember_localcluster.leaderworkerset import crd_manifest as lws_crd_manifest
        from ember_localcluster.leaderworkerset_controller import LeaderWorkerSetController
        from ember_localcluster.nodelifecycle_controller import NodeLifecycleController
        from ember_localcluster.podgc_controller import PodGCController
        from ember_localcluster.proxy import ServiceProxy
        from ember_localcluster.scheduler import Scheduler
        from ember_localcluster.tainteviction_controller import TaintEvictionController
        from ember_operator.crd import crd_manifest

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "models").mkdir(exist_ok=True)
        try:
            # Only a kubelet confirms a pod's deletion: a lost node's pods stay Terminating.
            self.api = APIServer(port=self.port, pod_kill_margin=None).start()
        except OSError as error:
            raise PortInUse(self.port, error) from error
        try:
            self.api.write_kubeconfig(self.kubeconfig)
            self.api.install_crd(crd_manifest())
            self.api.install_crd(lws_crd_manifest())
            # The operator's own client reads $KUBECONFIG when it first connects.
            os.environ["KUBECONFIG"] = str(self.kubeconfig)
            self.leaderworkersets = LeaderWorkerSetController(self.kubeconfig).start()
            self.deployments = DeploymentController(self.kubeconfig).start()
            self.disruption = DisruptionController(self.kubeconfig).start()
            self.scheduler = Scheduler(self.kubeconfig).start()
            self.kubelet = ProcessKubelet(
                self.kubeconfig,
                self.dir / "kubelet",
                claims={MODEL_CLAIM: self.dir / "models"},
                nodes=self.nodes,
                backoff_initial=self.backoff_initial,
                backoff_max=self.backoff_max,
                lease_seconds=self.node_lease_seconds,
            ).start()
            self.nodelifecycle = NodeLifecycleController(
                self.kubeconfig,
                monitor_period=self.node_monitor_period,
                grace_period=self.node_monitor_grace_period,
            ).start()
            self.tainteviction = TaintEvictionController(self.kubeconfig).start()
            self.podgc = PodGCController(self.kubeconfig, period=self.pod_gc_period).start()
            self.api.attach_kubelet(self.kubelet.node_names, self.kubelet.pods_dir)
            self.proxy = ServiceProxy(self.kubeconfig).start()
            self._operator = threading.Thread(target=self._run_operator, name="ember-operator", daemon=True)
            self._operator.start()
            if self.prometheus_port is not None:
                self._start_prometheus()
        except BaseException:
            self.stop()  # what did start must not outlive the failure
            raise
        return self

    def stop_node(self, name: str) -> None:
        """Lose node `name` as a power cut would (`ProcessKubelet.stop_node`)."""
        self.kubelet.stop_node(name)

    def start_node(self, name: str) -> None:
        """Bring node `name` back (`ProcessKubelet.start_node`)."""
        self.kubelet.start_node(name)

    def _start_prometheus(self) -> None:
        """Serve the operator's /metrics, publish it as a Service whose Endpoints name that address (how
        Kubernetes exposes a backend outside the cluster, here the operator in this process), and start
        Prometheus with the shipped scrape jobs."""
        from ember_localcluster.prometheus import LocalPrometheus
        from ember_operator import metrics

        self._metrics_server = metrics.serve(0, addr="127.0.0.1")
        port = self._metrics_server.server_address[1]
        labels = {"app.kubernetes.io/name": "ember-operator", "app.kubernetes.io/part-of": "ember"}
        meta = {"name": "ember-operator-metrics", "namespace": OPERATOR_NAMESPACE, "labels": labels}
        ports = [{"name": "metrics", "port": port, "protocol": "TCP"}]
        self.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}})
        self.api.create({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"ports": ports}})
        endpoints = {"subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": ports}]}
        self.api.create({"apiVersion": "v1", "kind": "Endpoints", "metadata": meta, **endpoints})
        assert self.prometheus_port is not None
        self.prometheus = LocalPrometheus(
            self.kubeconfig, self.dir / "prometheus", self.prometheus_port, self.scrape_interval
        ).start()

    def _run_operator(self) -> None:
        import kopf

        from ember_operator import main as operator_main
        from ember_operator.handlers import Settings, register

        registry = kopf.OperatorRegistry()
        register(registry, Settings(tick=self.tick))
        url = self.api.url

        @kopf.on.login(registry=registry)
        def login(**_: object) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True, default_namespace="default")

        parser = argparse.ArgumentParser()
        operator_main.add_arguments(parser)
        settings = operator_main.operator_settings(
            parser.parse_args(["--standalone", "--tick", str(self.tick)])
        )
        try:
            asyncio.run(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    standalone=True,
                    clusterwide=True,
                    stop_flag=self._stop_operator,
                )
            )
        except BaseException as e:  # reported by `ember dev run`, which then stops everything
            self.operator_error = e

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self._stop_operator.set()
        if self._operator is not None:
            self._operator.join(timeout=15)
        for part in (
            self.podgc,
            self.tainteviction,
            self.nodelifecycle,
            self.proxy,
            self.kubelet,
            self.scheduler,
            self.disruption,
            self.deployments,
            self.leaderworkersets,
            self.api,
        ):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()


def _pid_file(directory: Path) -> Path:
    return directory / "dev.pid"


def _lock(directory: Path, name: str, *, wait: bool) -> int | None:
    """An open descriptor of `<directory>/<name>` holding its exclusive flock; None when another process
    holds it and `wait` is False. The lock goes with the descriptor (closed, or its process gone)."""
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _one_command_at_a_time(directory: Path) -> Iterator[None]:
    """One `ember dev up` or `down` at a time per directory, from its check to the control plane's start."""
    commands = _lock(directory, COMMANDS_LOCK, wait=True)
    try:
        yield
    finally:
        if commands is not None:
            os.close(commands)


def _running_pid(directory: Path, timeout: float = 0.0) -> int | None:
    """The process id of the control plane running in `directory` (the one holding `dev.lock`), waiting
    up to `timeout` seconds for one that is starting to write it; None when none runs. When none runs,
    what a control plane that died left (pods' processes, files) is cleaned up first."""
    free = _lock(directory, RUNNING_LOCK, wait=False)
    if free is not None:
        try:
            _reap(directory)
        finally:
            os.close(free)
        return None
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            pid = int(_pid_file(directory).read_text())
            os.kill(pid, 0)
            return pid
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def _reap(directory: Path) -> None:
    """End the pods' processes a control plane of `directory` that died left running, and its files."""
    from ember_localcluster.kubelet.kubelet import kill_recorded_processes

    killed = kill_recorded_processes(directory / "kubelet")
    if killed:
        print(
            f"ember dev: killed {len(killed)} pod process(es) left by a control plane that did not stop: "
            + " ".join(map(str, killed)),
            flush=True,
        )
    for leftover in (_pid_file(directory), directory / "ready"):
        leftover.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    """Foreground: run the cluster until SIGTERM or SIGINT."""
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    # Held for as long as this process lives: one control plane per directory.
    running = _lock(directory, RUNNING_LOCK, wait=False)
    if running is None:
        print(f"ember dev: already running in {directory}{_address(directory)}", file=sys.stderr, flush=True)
        return 1
    _reap(directory)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = DevCluster(
        directory,
        port=args.port,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        taints=args.taint,
        prometheus_port=args.prometheus_port if args.prometheus else None,
    )
    try:
        cluster.start()
    except OSError as error:
        print(f"ember dev: {error.strerror or error}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as error:  # Prometheus could not start
        print(f"ember dev: {error}", file=sys.stderr, flush=True)
        return 1
    try:
        _pid_file(directory).write_text(str(os.getpid()))
        (directory / "ready").write_text(cluster.api.url)
        names = ", ".join(n.name for n in cluster.nodes)
        print(f"ember dev: API server {cluster.api.url}; nodes {names}", flush=True)
        print(f"ember dev: export KUBECONFIG={cluster.kubeconfig}", flush=True)
        if cluster.prometheus is not None:
            print(f"ember dev: Prometheus {cluster.prometheus.url}", flush=True)
        while not stop.wait(0.5):
            _serve_node_requests(cluster, directory)
            if cluster.operator_error is not None:
                print(f"ember dev: the operator stopped: {cluster.operator_error!r}", file=sys.stderr)
                break
    finally:
        cluster.stop()
    for leftover in (_pid_file(directory), directory / "ready"):
        leftover.unlink(missing_ok=True)
    os.close(running)
    return 1 if cluster.operator_error is not None else 0


NODE_REQUESTS = "node-requests"  # `ember dev node stop|start NAME` → the running control plane


def _serve_node_requests(cluster: DevCluster, directory: Path) -> None:
    """Carry out each `<id>.request` (`stop NAME` or `start NAME`), answering in `<id>.done`."""
    for request in sorted((directory / NODE_REQUESTS).glob("*.request")):
        try:
            action, name = request.read_text().split()
            {"stop": cluster.stop_node, "start": cluster.start_node}[action](name)
            answer = f"node {name} {'stopped' if action == 'stop' else 'started'}"
        except (KeyError, ValueError, OSError, RuntimeError) as error:
            answer = f"error: {error.args[0] if error.args else error}"
        request.with_suffix(".done").write_text(answer)
        request.unlink(missing_ok=True)


def node(args: argparse.Namespace) -> int:
    """`ember dev node stop|start NAME`: lose a node of the running control plane as a power cut would, or
    bring it back."""
    directory = Path(args.dir).resolve()
    if not directory.is_dir() or _running_pid(directory) is None:
        print("ember dev: not running", file=sys.stderr)
        return 1
    requests = directory / NODE_REQUESTS
    requests.mkdir(exist_ok=True)
    ident = f"{os.getpid()}-{time.monotonic_ns()}"
    (requests / f".{ident}").write_text(f"{args.action} {args.name}")
    (requests / f".{ident}").rename(requests / f"{ident}.request")
    done = requests / f"{ident}.done"
    deadline = time.monotonic() + args.timeout
    while not done.exists():
        if time.monotonic() > deadline:
            (requests / f"{ident}.request").unlink(missing_ok=True)
            print(f"ember dev: no answer in {args.timeout:g} s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    answer = done.read_text()
    done.unlink()
    print(f"ember dev: {answer}", file=sys.stderr if answer.startswith("error") else sys.stdout)
    return 1 if answer.startswith("error") else 0


def up(args: argparse.Namespace) -> int:
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with _one_command_at_a_time(directory):
        return _up(args, directory)


def _up(args: argparse.Namespace, directory: Path) -> int:
    kubeconfig = directory / "kubeconfig"
    if _running_pid(directory) is not None:
        print(f"ember dev: already running{_address(directory)}; export KUBECONFIG={kubeconfig}")
        return 0
    busy = _port_busy(args.port)
    if busy is not None:
        print(f"ember dev: {busy.strerror}", file=sys.stderr)
        return 1
    tiny = directory / "models" / "tiny"
    if not (tiny / "model.safetensors").exists():
        from ember_engine.tools.testmodel import make_test_model

        make_test_model(tiny, size="tiny", force=True)
    (directory / "ready").unlink(missing_ok=True)
    log = (directory / "dev.log").open("ab")
    log_start = log.tell()
    ember = str(Path(sys.executable).parent / "ember")
    node_args = ["--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node)]
    for taint in args.taint:
        node_args += ["--taint", _taint_text(taint)]
    if args.prometheus:
        node_args += ["--prometheus", "--prometheus-port", str(args.prometheus_port)]
    proc = subprocess.Popen(
        [ember, "dev", "run", "--dir", str(directory), "--port", str(args.port), *node_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=directory,
        start_new_session=True,  # outlives this command and the terminal
    )
    deadline = time.monotonic() + args.timeout
    while not (directory / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = _failure(directory / "dev.log", log_start) if proc.poll() is not None else "timed out"
            print(f"ember dev: the control plane did not start: {why}", file=sys.stderr)
            print(f"ember dev: the whole log: {directory / 'dev.log'}", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            _wait_gone(proc.pid, args.timeout)
            return 1
        time.sleep(0.1)
    print(f"ember dev: up (API server {(directory / 'ready').read_text()}, log {directory / 'dev.log'})")
    if args.prometheus:
        print(f"ember dev: Prometheus http://127.0.0.1:{args.prometheus_port}")
    print(f"export KUBECONFIG={kubeconfig}")
    return 0


def down(args: argparse.Namespace) -> int:
    directory = Path(args.dir).resolve()
    if not directory.is_dir():
        print("ember dev: not running")
        return 0
    with _one_command_at_a_time(directory):
        return _down(args, directory)


def _down(args: argparse.Namespace, directory: Path) -> int:
    pid = _running_pid(directory, args.timeout)
    if pid is None:
        print("ember dev: not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    # The process removes its pid file as it finishes, before it has exited: wait for the process itself.
    if not _wait_gone(pid, args.timeout):
        print(f"ember dev: pid {pid} did not stop in {args.timeout:g} s; killing it", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _wait_gone(pid, 10)
        _running_pid(directory)  # the lock is free now: what it left goes
        return 1
    print("ember dev: down")
    return 0


def _address(directory: Path) -> str:
    """` (API server <url>)` of the control plane running in `directory`, once it has started."""
    with contextlib.suppress(OSError):
        return f" (API server {(directory / 'ready').read_text()})"
    return ""


def _port_busy(port: int) -> OSError | None:
    """Why the API server could not listen on `port`, found before starting anything; None when it can."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            return PortInUse(port, error)
    return None


def _failure(log: Path, start: int) -> str:
    """The line of what this run wrote to the log that says why it stopped."""
    with log.open("rb") as f:
        f.seek(start)
        lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("ember dev: ")]
    if ours:
        return ours[-1].removeprefix("ember dev: ")
    return lines[-1] if lines else "it exited without a word"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie has exited; only its parent has yet to collect it
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _taint_text(taint: Mapping[str, str]) -> str:
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint['key']}{value}:{taint['effect']}"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _not_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _taint(text: str) -> dict[str, str]:
    try:
        return parse_taint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dev", metavar="ACTION", required=True)
    for name, text in (
        ("up", "start the local control plane in the background and write a kubeconfig"),
        ("down", "stop it and the engine processes it runs"),
        ("run", "run it in the foreground"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("--dir", default=str(default_dir()), help="state directory (default: %(default)s)")
        if name != "down":
            q.add_argument(
                "--port", type=int, default=DEFAULT_PORT, help="API server port (default: %(default)s)"
            )
            q.add_argument(
                "--nodes", type=_positive, default=1, help="nodes to register (default: %(default)s)"
            )
            q.add_argument(
                "--gpus-per-node",
                type=_not_negative,
                default=DEFAULT_GPUS_PER_NODE,
                help="nvidia.com/gpu each node offers to the scheduler (default: %(default)s; engines "
                "run on the CPU here whatever the number)",
            )
            q.add_argument(
                "--prometheus",
                action="store_true",
                help="also run Prometheus (Debian's prometheus package) scraping the engines and the operator "
                "with manifests/monitoring's scrape jobs and alerts",
            )
            q.add_argument(
                "--prometheus-port",
                type=int,
                default=DEFAULT_PROMETHEUS_PORT,
                help="Prometheus's port on 127.0.0.1 (default: %(default)s)",
            )
            q.add_argument(
                "--taint",
                type=_taint,
                action="append",
                default=[],
                metavar="KEY[=VALUE]:EFFECT",
                help="taint every node with this (repeatable), as kubelet --register-with-taints",
            )
        if name != "run":
            q.add_argument(
                "--timeout", type=float, default=60.0, help="seconds to wait (default: %(default)s)"
            )
    q = sub.add_parser(
        "node",
        help="stop a node of the running control plane as a power cut would (its lease no longer renewed, "
        "its pods' processes killed), or start it again",
    )
    q.add_argument("action", choices=("stop", "start"))
    q.add_argument("name", help="the node's name (ember-local, ember-local-2, ...)")
    q.add_argument("--dir", default=str(default_dir()), help="state directory (default: %(default)s)")
    q.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    return int({"up": up, "down": down, "run": run, "node": node}[args.dev](args))
