"""What `ember demo` does through kubectl: each step prints its `$ kubectl ...` line, then runs it with the
kubectl on PATH, or, where there is none, does the same through the Kubernetes Python client and prints
the table kubectl would. `EisWatch` prints `kubectl get eis -w`-style lines: a row each time an
InferenceService's printed columns change, read from the API server's Table output (the columns kubectl
prints, from the CRD's additionalPrinterColumns).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
NAMESPACE = "default"
PATHS = {  # what the demo gets, as kubectl names it -> its collection in the API
    "nodes": "/api/v1/nodes",
    "pods": f"/api/v1/namespaces/{NAMESPACE}/pods",
    "eis": f"/apis/ember.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices",
}


# -- printing (pure) ---------------------------------------------------------------------------------------


def age(created: str, now: datetime.datetime) -> str:
    """kubectl's short age: 45s, 3m12s, 2h5m, 3d."""
    start = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
    seconds = max(0, int((now - start).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    return f"{hours}h" if hours < 48 else f"{hours // 24}d"


def table_lines(
    table: dict[str, Any], now: datetime.datetime, wide: bool = False
) -> tuple[list[str], list[list[str]]]:
    """The header and each row's cells as kubectl prints them (priority-0 columns unless `wide`; a date
    as an age, a missing value blank)."""
    columns = [c for c in table["columnDefinitions"] if wide or not c.get("priority")]
    keep = [i for i, c in enumerate(table["columnDefinitions"]) if wide or not c.get("priority")]
    header = [c["name"].upper() for c in columns]
    rows = []
    for row in table.get("rows") or []:
        cells = []
        for i in keep:
            value = row["cells"][i] if i < len(row["cells"]) else None
            kind = table["columnDefinitions"][i].get("type")
            if value is None or value == "":
                cells.append("<unknown>" if kind == "date" else "")
            elif kind == "date":
                cells.append(age(str(value), now))
            elif isinstance(value, float):
                cells.append(f"{value:g}")
            else:
                cells.append(str(value))
        rows.append(cells)
    return header, rows


def aligned(lines: Sequence[Sequence[str]], widths: Sequence[int] | None = None) -> list[str]:
    """Columns padded as kubectl's tabwriter pads them: each cell to its column's widest plus 3, and
    to at least 6."""
    if widths is None:
        widths = [max(max(len(line[i]) for line in lines) + 3, 6) for i in range(len(lines[0]))]
    # A cell wider than its column (kubectl -w keeps the widths of its first lines) still gets its 3.
    return [
        "".join(cell.ljust(max(w, len(cell) + 3)) for cell, w in zip(line, widths, strict=False)).rstrip()
        for line in lines
    ]


# -- I/O ---------------------------------------------------------------------------------------------------


class Kubectl:
    """kubectl against one kubeconfig, or the Python client standing in for it."""

    def __init__(self, kubeconfig: Path, cache_dir: Path, binary: str | None = None) -> None:
        from kubernetes import client, config

        self.kubeconfig = kubeconfig
        self.cache_dir = cache_dir
        self.binary = binary if binary is not None else shutil.which("kubectl")
        self.api = config.new_client_from_config(str(kubeconfig))
        self.custom = client.CustomObjectsApi(self.api)

    @property
    def how(self) -> str:
        return (
            f"kubectl ({self.binary})" if self.binary else "the Kubernetes Python client, in kubectl's place"
        )

    def show(self, *args: str) -> str:
        """Print `$ kubectl ARGS` and what it prints; returns that."""
        print(f"$ kubectl {' '.join(args)}", flush=True)
        out = self._kubectl(args) if self.binary else self._client(args)
        print("\n".join(f"  {line}" for line in out.rstrip().splitlines()), flush=True)
        return out

    def _kubectl(self, args: Sequence[str]) -> str:
        assert self.binary is not None
        command = [self.binary, "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.cache_dir)]
        done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout + done.stderr  # "No resources found" comes on stderr

    def _client(self, args: Sequence[str]) -> str:
        verb, rest = args[0], list(args[1:])
        if verb == "get":
            labels = [rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "-L"]
            return "\n".join(self.rows(rest[0], label_columns=labels)) + "\n"
        if verb in ("apply", "delete") and rest[:1] == ["-f"]:
            docs = [d for d in yaml.safe_load_all(Path(rest[1]).read_text()) if d]
            return "".join(self._apply(d) if verb == "apply" else self._delete(d) for d in docs)
        raise ValueError(f"no Python-client stand-in for kubectl {' '.join(args)}")

    def _apply(self, doc: dict[str, Any]) -> str:
        from kubernetes.client import ApiException

        group, version = doc["apiVersion"].split("/")
        name = doc["metadata"]["name"]
        try:
            self.custom.create_namespaced_custom_object(group, version, NAMESPACE, "inferenceservices", doc)
            return f"inferenceservice.{group}/{name} created\n"
        except ApiException as e:
            if e.status != 409:
                raise
        patch = {"metadata": {"labels": doc["metadata"].get("labels") or {}}, "spec": doc["spec"]}
        self.custom.patch_namespaced_custom_object(
            group, version, NAMESPACE, "inferenceservices", name, patch
        )
        return f"inferenceservice.{group}/{name} configured\n"

    def _delete(self, doc: dict[str, Any]) -> str:
        group, version = doc["apiVersion"].split("/")
        name = doc["metadata"]["name"]
        self.custom.delete_namespaced_custom_object(group, version, NAMESPACE, "inferenceservices", name)
        return f'inferenceservice.{group} "{name}" deleted\n'

    def read(self, what: str, name: str = "", *, selector: str = "", table: bool = False) -> dict[str, Any]:
        """GET one object (`name`) or the list of `what` (nodes, pods, eis), as JSON, or as the API
        server's Table for `kubectl get <what>`."""
        accept = TABLE if table else "application/json"
        method, url, headers, _, _ = self.api.param_serialize(
            "GET",
            PATHS[what] + (f"/{name}" if name else ""),
            query_params=[("labelSelector", selector)] if selector else [],
            header_params={"Accept": accept},
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(method, url, headers, _request_timeout=30)
        if response.status != 200:
            raise RuntimeError(f"GET {url}: {response.status} {response.read()[:200]!r}")
        return dict(json.loads(response.read()))

    def table(self, what: str) -> dict[str, Any]:
        return self.read(what, table=True)

    def rows(self, what: str, label_columns: Sequence[str] = ()) -> list[str]:
        """`kubectl get <what> [-L label]` as kubectl prints it."""
        table = self.table(what)
        header, rows = table_lines(table, datetime.datetime.now(datetime.UTC))
        if not rows:
            return ["No resources found in default namespace."]
        header += [label.rsplit("/", 1)[-1].upper() for label in label_columns]
        objects = self.read("pods")["items"] if label_columns else []
        labels = {p["metadata"]["name"]: p["metadata"].get("labels") or {} for p in objects}
        rows = [row + [labels.get(row[0], {}).get(label, "") for label in label_columns] for row in rows]
        return aligned([header, *rows])


class EisWatch:
    """`kubectl get eis -w`, in a thread while `running()`: the header and every row, then a row each
    time an InferenceService's printed columns (all but AGE) change."""

    def __init__(self, kubectl: Kubectl, interval: float = 0.5) -> None:
        self.kubectl = kubectl
        self.interval = interval
        self._last: dict[str, list[str]] = {}
        self._header = True

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        print("$ kubectl get eis -w", flush=True)
        self._last, self._header = {}, True
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(stop,), name="eis-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)
            with contextlib.suppress(Exception):
                self.poll()  # what changed since the last interval

    def _run(self, stop: threading.Event) -> None:
        while True:
            with contextlib.suppress(Exception):  # a failed read is retried at the next interval
                self.poll()
            if stop.wait(self.interval):
                return

    def poll(self) -> None:
        header, rows = table_lines(self.kubectl.table("eis"), datetime.datetime.now(datetime.UTC))
        # kubectl -w sizes the columns by the first rows it prints; these fit the demo's.
        widths = [16] + [max(len(h) + 3, 9) for h in header[1:]]
        if self._header:
            self._header = False
            print(aligned([header], widths)[0], flush=True)
        for row in rows:
            if self._last.get(row[0], [])[:-1] != row[:-1]:
                self._last[row[0]] = row
                print(aligned([row], widths)[0], flush=True)
