"""`ember demo` (`make demo`): the whole demo run as a user runs it, its output checked step by step; and
its kubectl stand-in (the Kubernetes Python client, for machines without kubectl) printing what kubectl
prints, against the API server."""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember_localcluster.apiserver import APIServer
from ember_localcluster.demo import EXAMPLE
from ember_localcluster.demo_kubectl import Kubectl, age, aligned, table_lines
from ember_operator.crd import crd_manifest

EMBER = str(Path(sys.executable).parent / "ember")
NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize(
    ("seconds", "printed"),
    [
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (192, "3m12s"),
        (900, "15m"),
        (3 * 3600, "3h"),
        (3 * 86400, "3d"),
    ],
)
def test_age_is_printed_as_kubectl_prints_it(seconds: int, printed: str) -> None:
    created = (NOW - datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert age(created, NOW) == printed


def test_a_table_prints_its_priority_zero_columns_with_ages_and_nones() -> None:
    table = {
        "columnDefinitions": [
            {"name": "Name", "type": "string"},
            {"name": "Ready", "type": "string"},
            {"name": "Queue", "type": "number"},
            {"name": "Hidden", "type": "string", "priority": 1},
            {"name": "Age", "type": "date"},
        ],
        "rows": [{"cells": ["tiny", "True", 1.5, "x", "2026-01-01T11:59:00Z"]}, {"cells": ["b", None, 0.0]}],
    }
    header, rows = table_lines(table, NOW)
    assert header == ["NAME", "READY", "QUEUE", "AGE"]
    assert rows == [["tiny", "True", "1.5", "60s"], ["b", "", "0", "<unknown>"]]
    assert aligned([header, *rows]) == [
        "NAME   READY   QUEUE   AGE",
        "tiny   True    1.5     60s",
        "b              0       <unknown>",
    ]


def test_without_kubectl_the_client_applies_gets_and_deletes_as_kubectl_would(tmp_path: Path) -> None:
    kubectl_bin = shutil.which("kubectl")
    assert kubectl_bin, "kubectl is part of the machine setup (apt install kubectl), to compare with"
    with APIServer() as api:
        api.install_crd(crd_manifest())
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        client = Kubectl(kubeconfig, tmp_path / "cache", binary="")
        real = Kubectl(kubeconfig, tmp_path / "cache", binary=kubectl_bin)
        assert "Python client" in client.how

        applied = client.show("apply", "-f", str(EXAMPLE))
        assert applied.splitlines() == [
            "inferenceservice.ember.dev/tiny created",
            "inferenceservice.ember.dev/tiny-fallback created",
        ]
        assert client.show("apply", "-f", str(EXAMPLE)).splitlines() == [
            "inferenceservice.ember.dev/tiny configured",
            "inferenceservice.ember.dev/tiny-fallback configured",
        ]

        ours, theirs = client.show("get", "eis"), real.show("get", "eis")
        # The same columns, names and cells, AGE aside (a second may tick between the two).
        assert [_no_age(line) for line in ours.splitlines()] == [
            _no_age(line) for line in theirs.splitlines()
        ]
        assert theirs.split()[:9] == [
            "NAME",
            "READY",
            "ACTIVE",
            "WARM",
            "DESIRED",
            "QUEUE",
            "KV",
            "ROUTERS",
            "AGE",
        ]

        deleted = client.show("delete", "-f", str(EXAMPLE))
        assert deleted.splitlines() == [
            'inferenceservice.ember.dev "tiny" deleted',
            'inferenceservice.ember.dev "tiny-fallback" deleted',
        ]
        assert (
            client.show("get", "eis")
            == real.show("get", "eis")
            == "No resources found in default namespace.\n"
        )


def _no_age(line: str) -> str:
    return re.sub(r"\s+\d+s$", "", line)


def test_the_demo_runs_every_step_and_tears_down(tmp_path: Path) -> None:
    demo = subprocess.run(
        [EMBER, "demo", "--dir", str(tmp_path / "dev"), "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = demo.stdout
    assert demo.returncode == 0, out + demo.stderr
    steps = re.findall(r"^== (\d)\. ", out, flags=re.M)
    assert steps == list("12345678"), out
    assert "ember dev: up" in out and "$ kubectl apply -f" in out
    # kubectl get eis -w: the header, then tiny with its warm pod and both routers Ready, then two active after
    # the spike.
    header = r"^NAME\s+READY\s+ACTIVE\s+WARM\s+DESIRED\s+QUEUE\s+KV\s+ROUTERS\s+AGE$"
    assert re.search(header, out, flags=re.M), out
    assert re.search(r"^tiny\s+True\s+1\s+1\s+1\s.*\s2/2\s", out, flags=re.M), out
    assert re.search(r"^tiny\s+True\s+2\s+\d\s+2\s", out, flags=re.M), out
    chunks = re.search(r"\[(\d+) chunks; the first after \d+ ms\]", out)
    assert chunks and int(chunks.group(1)) > 1, out
    assert re.search(r"tiny-[\w-]+ promoted from warm to active", out), out
    assert re.search(r"\d+ × 200 served by tiny-fallback \(x-ember-served-by: fallback\)", out), out
    assert re.search(r"\d+ × 503 (fleet_overloaded|queue_full) Retry-After: \d+", out), out
    assert "No resources found" in out
    assert "ember dev: down" in out
    assert not (tmp_path / "dev" / "dev.pid").exists()
