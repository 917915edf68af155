"""`ember operator` as a real process: it reconciles, serves /healthz and /metrics, and stops on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import plainhttp
import yaml
from operator_harness import NAMESPACE, crd_manifest
from waiting import free_port, wait_for

from ember_localcluster.apiserver import APIServer
from ember_operator.spec import GROUP, VERSION

EMBER = str(Path(sys.executable).parent / "ember")


@contextlib.contextmanager
def operator_process(kubeconfig: Path, log: Path, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """`ember operator FLAGS` against `kubeconfig`; on exit, SIGTERM and a check that it stopped cleanly."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [EMBER, "operator", "--tick", "0.3", *flags], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
    assert code == 0, log.read_text()[-3000:]


def test_ember_operator_help_lists_its_options() -> None:
    out = subprocess.run([EMBER, "operator", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--standalone",
        "--peering",
        "--health-port",
        "--metrics-port",
    ):
        assert flag in out.stdout


def test_ember_operator_runs_reconciles_and_stops(tmp_path: Path) -> None:
    health, metrics = free_port(), free_port()
    with APIServer(pod_graceful_deletion=False) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        api.install_crd(crd_manifest())
        with operator_process(
            kubeconfig,
            tmp_path / "operator.log",
            *(
                "--namespace",
                NAMESPACE,
                "--standalone",
                f"--health-port={health}",
                f"--metrics-port={metrics}",
            ),
        ):
            api.create(
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "InferenceService",
                    "metadata": {"name": "cli", "namespace": NAMESPACE},
                    "spec": {"model": {"name": "m", "source": "/models/m"}, "warmPool": {"size": 1}},
                }
            )
            # No kubelet here: the pods are created and stay unready, and status says so.
            wait_for(
                lambda: (
                    len(api.list("v1", "Pod", NAMESPACE, label_selector="app.kubernetes.io/instance=cli"))
                    == 2
                ),
                timeout=60,
                what="two engine pods",
            )

            def reports_unready() -> bool:
                obj = api.get(f"{GROUP}/{VERSION}", "InferenceService", NAMESPACE, "cli") or {}
                ready = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"]
                return bool(ready) and ready[0]["status"] == "False"

            wait_for(reports_unready, timeout=30, what="Ready=False in status")
            assert plainhttp.get(f"http://127.0.0.1:{health}/healthz", timeout=5).status_code == 200
            page = plainhttp.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
            assert 'ember:operator_reconciles_total{name="cli",namespace="default",result="ok"}' in page
            assert (
                'ember:operator_pod_changes_total{change="created",name="cli",namespace="default"} 2.0'
                in page
            )
            # No decision yet (no pod is Ready), yet both directions' counters are there, at 0.
            for direction in ("up", "down"):
                series = f'ember:operator_scaling_decisions_total{{direction="{direction}",name="cli",namespace="default"}}'
                assert f"{series} 0.0" in page


def test_ember_operator_with_peering_keeps_alive_in_the_peering_object_and_reconciles(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    with APIServer(pod_graceful_deletion=False) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        api.install_crd(crd_manifest())
        for crd in yaml.safe_load_all((repo / "manifests" / "peering" / "crds.yaml").read_text()):
            api.install_crd(crd)
        api.create(yaml.safe_load((repo / "manifests" / "ha" / "peering.yaml").read_text()))
        with operator_process(
            kubeconfig,
            tmp_path / "operator.log",
            *("--all-namespaces", "--peering", "ember-operator", "--health-port=0", "--metrics-port=0"),
        ):

            def peers() -> dict[str, object]:
                obj = api.get("kopf.dev/v1", "ClusterKopfPeering", None, "ember-operator") or {}
                return dict(obj.get("status") or {})

            (identity,) = wait_for(peers, timeout=60, what="a keep-alive in the ClusterKopfPeering").keys()
            assert int(peers()[identity]["priority"]) > 0  # drawn at random: no tie with a second replica
            api.create(
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "InferenceService",
                    "metadata": {"name": "peered", "namespace": NAMESPACE},
                    "spec": {"model": {"name": "m", "source": "/models/m"}},
                }
            )
            wait_for(
                lambda: api.list("v1", "Pod", NAMESPACE, label_selector="app.kubernetes.io/instance=peered"),
                timeout=60,
                what="the active peer reconciling",
            )
