"""The install manifests, rendered by kubectl's own kustomize: what they create, run and grant."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember_engine.cli import build_parser
from ember_operator.main import peering_priority
from ember_operator.spec import GROUP, KIND, PLURAL

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
NAMESPACE = "ember-system"
IMAGE = "ghcr.io/ember-dev/ember-operator:0.1.0"
BASE_ARGS = ["--all-namespaces", "--standalone", "--health-port=8081", "--metrics-port=8080"]
HA_ARGS = ["--all-namespaces", "--peering=ember-operator", "--health-port=8081", "--metrics-port=8080"]

# (apiGroup, resource, verb): everything the operator is allowed, and nothing else. tests/test_rbac.py
# derives these from the requests of the running operator; here they are pinned, so that a change shows.
NAMESPACED_GRANTS = {
    *((GROUP, PLURAL, v) for v in ("get", "list", "watch", "patch")),
    (GROUP, f"{PLURAL}/status", "patch"),
    (GROUP, f"{PLURAL}/finalizers", "update"),  # blockOwnerDeletion: true, see base/rbac.yaml
    *(("", "pods", v) for v in ("create", "delete", "patch", "list", "watch")),
    # Children: read, watched (an edit or deletion is put back at the next pass), made and put back.
    *(("", r, v) for r in ("services", "configmaps") for v in ("get", "list", "watch", "create", "update")),
    *(("policy", "poddisruptionbudgets", v) for v in ("get", "list", "watch", "create", "update")),
    *(("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in ("list", "create", "patch", "delete")),
    *(("apps", "deployments", v) for v in ("get", "list", "watch", "create", "update", "delete")),
    *(
        ("rbac.authorization.k8s.io", "rolebindings", v)
        for v in ("get", "list", "watch", "create", "update", "delete")
    ),
    *(("", "serviceaccounts", v) for v in ("get", "list", "watch", "create", "update", "delete")),
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),  # ember-router only, see base/rbac.yaml
    ("", "events", "create"),
}
# The router pods' ClusterRole: they find their engines, and never write.
ROUTER_GRANTS = {("", "pods", v) for v in ("get", "list", "watch")}
OBSERVER_GRANTS = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
OPERATOR_GRANTS = NAMESPACED_GRANTS | OBSERVER_GRANTS
# With --namespace, cluster-wide only kopf's observers: namespaces and CRDs, read-only.
NAMESPACED_CLUSTER_GRANTS = OBSERVER_GRANTS | {("", "namespaces", v) for v in ("list", "watch")}
PEERING_GRANTS = {("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")}
WATCHED = "default"
NAMESPACED_ARGS = [f"--namespace={WATCHED}", "--standalone", "--health-port=8081", "--metrics-port=8080"]
SUBJECTS = [{"kind": "ServiceAccount", "name": "ember-operator", "namespace": NAMESPACE}]


def _kubectl() -> str:
    found = shutil.which("kubectl") or ("/usr/bin/kubectl" if Path("/usr/bin/kubectl").exists() else None)
    if found is None:
        pytest.fail("kubectl is required to render manifests/ (kubectl kustomize); install kubectl >= 1.27")
    return found


def _run(*args: str) -> str:
    proc = subprocess.run([_kubectl(), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    docs = yaml.safe_load_all(_run("kustomize", str(MANIFESTS / overlay)))
    return tuple(d for d in docs if d is not None)


def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    out = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, (
            f"unexpected rule fields: {rule}"
        )
        # A grant limited by name is only ever the operator's `bind` of the routers' ClusterRole.
        assert rule.get("resourceNames", ["ember-router"]) == ["ember-router"], rule
        assert "resourceNames" not in rule or rule["verbs"] == ["bind"], rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    out.add((group, resource, verb))
    return out


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_the_root_is_the_base() -> None:
    assert render(".") == render("base")


def test_base_objects_and_namespace() -> None:
    docs = render(".")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ClusterRole", "ember-operator"),
        ("ClusterRole", "ember-router"),
        ("ClusterRoleBinding", "ember-operator"),
        ("Deployment", "ember-operator"),
        ("Namespace", NAMESPACE),
        ("Service", "ember-operator-metrics"),
        ("ServiceAccount", "ember-operator"),
    ]
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "ember"
        if doc["kind"] in ("ServiceAccount", "Deployment", "Service"):
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_two_step_install_has_the_crd_exactly_once() -> None:
    # README: `kubectl apply -f crds/` then `kubectl apply -k manifests`.
    crd_docs = [d for d in yaml.safe_load_all((REPO / "crds" / "inferenceservice.yaml").read_text()) if d]
    install = [*crd_docs, *render(".")]
    crds = [d for d in install if d["kind"] == "CustomResourceDefinition"]
    assert [c["metadata"]["name"] for c in crds] == [f"{PLURAL}.{GROUP}"]
    assert (crds[0]["spec"]["group"], crds[0]["spec"]["names"]["kind"]) == (GROUP, KIND)


def test_deployment_runs_the_operator_hardened() -> None:
    deployment = _one(render("."), "Deployment", "ember-operator")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    template = spec["template"]
    # The labels transformer must leave the immutable selector alone while still matching the pods.
    assert spec["selector"] == {"matchLabels": {"app.kubernetes.io/name": "ember-operator"}}
    assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["serviceAccountName"] == "ember-operator"
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = _container(deployment)
    assert container["image"] == IMAGE
    assert container["command"] == ["ember", "operator"]
    assert container["args"] == BASE_ARGS
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    resources = container["resources"]
    assert set(resources) == {"requests", "limits"}
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    (volume,) = pod["volumes"]
    assert volume["name"] == "tmp" and "emptyDir" in volume


def test_metrics_service_reaches_the_metrics_port() -> None:
    docs = render(".")
    service = _one(docs, "Service", "ember-operator-metrics")
    pod_labels = _one(docs, "Deployment", "ember-operator")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", 8080, "metrics")
    assert service["metadata"]["annotations"]["prometheus.io/port"] == "8080"


def test_cluster_role_grants_exactly_what_the_operator_uses() -> None:
    docs = render(".")
    assert grants(_one(docs, "ClusterRole", "ember-operator")) == OPERATOR_GRANTS
    binding = _one(docs, "ClusterRoleBinding", "ember-operator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "ember-operator",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ember-operator", "namespace": NAMESPACE}
    ]
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


def _documented_grants() -> set[tuple[str, str, str]]:
    """The RBAC table of manifests/README.md as (apiGroup, resource, verb). A Resource cell is one or more
    comma-separated `group` `resource` (or `resource` alone, core), a resource name possibly after it."""
    text = (MANIFESTS / "README.md").read_text()
    section = text[text.index("\n### RBAC\n") :]
    rows = re.findall(r"^\| (`.*?) \| (.*?) \| .* \|$", section.split("\n### ", 2)[1], flags=re.M)
    assert rows, "manifests/README.md has its RBAC table"
    out = set()
    for resources, verbs in rows:
        for part in resources.split(", "):
            tokens = re.findall(r"`([^`]+)`", part)
            group, resource = (tokens[0], tokens[1]) if len(tokens) > 1 else ("", tokens[0])
            for verb in verbs.split(","):
                out.add((group, resource, verb.split()[0]))
    return out


def test_readme_rbac_table_lists_every_grant_of_every_install() -> None:
    documented = _documented_grants()
    shipped = OPERATOR_GRANTS | NAMESPACED_CLUSTER_GRANTS | PEERING_GRANTS
    assert documented == shipped, (
        f"granted, not in manifests/README.md's RBAC table: {sorted(shipped - documented)}; "
        f"in the table, not granted: {sorted(documented - shipped)}"
    )


def test_router_cluster_role_only_reads_pods_and_the_operator_may_bind_only_it() -> None:
    for overlay in (".", "namespaced"):
        docs = render(overlay)
        assert grants(_one(docs, "ClusterRole", "ember-router")) == ROUTER_GRANTS
        roles = [
            d
            for d in docs
            if d["kind"] in ("ClusterRole", "Role") and d["metadata"]["name"] == "ember-operator"
        ]
        binds = [rule for role in roles for rule in role["rules"] if "bind" in rule["verbs"]]
        assert binds == [
            {
                "apiGroups": ["rbac.authorization.k8s.io"],
                "resources": ["clusterroles"],
                "resourceNames": ["ember-router"],
                "verbs": ["bind"],
            }
        ]


def test_base_command_line_parses_as_ember_operator() -> None:
    container = _container(_one(render("."), "Deployment", "ember-operator"))
    assert container["command"][0] == "ember"
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert (args.command, args.all_namespaces, args.namespace) == ("operator", True, [])
    assert (args.standalone, args.peering) == (True, None)
    assert (args.health_port, args.metrics_port) == (8081, 8080)


def test_ha_command_line_parses_and_each_replica_draws_its_own_priority() -> None:
    container = _container(_one(render("ha"), "Deployment", "ember-operator"))
    assert container["command"][0] == "ember"
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert (args.command, args.all_namespaces, args.standalone, args.peering) == (
        "operator",
        True,
        False,
        "ember-operator",
    )
    assert (args.health_port, args.metrics_port, args.priority) == (8081, 8080, None)
    # kopf pauses every replica while two share the highest priority: each start draws a fresh one.
    draws = {peering_priority(args) for _ in range(3)}
    assert len(draws) > 1 and all(d > 0 for d in draws)


def test_ha_overlay_peers_two_replicas() -> None:
    docs = render("ha")
    deployment = _one(docs, "Deployment", "ember-operator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    container = _container(deployment)
    assert container["args"] == HA_ARGS
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    pdb = _one(docs, "PodDisruptionBudget", "ember-operator")
    assert pdb["metadata"]["namespace"] == NAMESPACE
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    # Everything else comes from the base unchanged.
    base = {(d["kind"], d["metadata"]["name"]) for d in render(".")}
    assert base <= {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_ha_overlay_ships_kopf_peering() -> None:
    docs = render("ha")
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert set(crds) == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    for name, scope, kind in (
        ("clusterkopfpeerings.kopf.dev", "Cluster", "ClusterKopfPeering"),
        ("kopfpeerings.kopf.dev", "Namespaced", "KopfPeering"),
    ):
        spec = crds[name]["spec"]
        assert (spec["group"], spec["scope"], spec["names"]["kind"]) == ("kopf.dev", scope, kind)
        (version,) = spec["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1", True, True)
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    # --peering NAME with --all-namespaces waits for the cluster-scoped peering object of that name.
    peering = _one(docs, "ClusterKopfPeering", "ember-operator")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert "namespace" not in peering["metadata"]
    assert grants(_one(docs, "ClusterRole", "ember-operator")) == OPERATOR_GRANTS
    assert grants(_one(docs, "ClusterRole", "ember-operator-peering")) == PEERING_GRANTS
    binding = _one(docs, "ClusterRoleBinding", "ember-operator-peering")
    assert binding["roleRef"]["name"] == "ember-operator-peering"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ember-operator", "namespace": NAMESPACE}
    ]


def test_namespaced_overlay_swaps_the_cluster_role_for_a_role_in_the_watched_namespace() -> None:
    docs = render("namespaced")
    kinds = sorted((d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ClusterRole", None, "ember-operator"),
        ("ClusterRole", None, "ember-router"),
        ("ClusterRoleBinding", None, "ember-operator"),
        ("Deployment", NAMESPACE, "ember-operator"),
        ("Namespace", None, NAMESPACE),
        ("Role", WATCHED, "ember-operator"),
        ("RoleBinding", WATCHED, "ember-operator"),
        ("Service", NAMESPACE, "ember-operator-metrics"),
        ("ServiceAccount", NAMESPACE, "ember-operator"),
    ]
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ember"
    assert grants(_one(docs, "ClusterRole", "ember-operator")) == NAMESPACED_CLUSTER_GRANTS
    assert grants(_one(docs, "Role", "ember-operator")) == NAMESPACED_GRANTS
    # Every cluster-wide grant of the namespaced install is read-only.
    assert {verb for _, _, verb in NAMESPACED_CLUSTER_GRANTS} == {"list", "watch"}
    binding = _one(docs, "RoleBinding", "ember-operator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "ember-operator",
    }
    assert binding["subjects"] == SUBJECTS
    assert _one(docs, "ClusterRoleBinding", "ember-operator")["subjects"] == SUBJECTS
    # Everything else comes from the base unchanged.
    base = {d["kind"]: d for d in render(".") if d["kind"] not in ("ClusterRole", "Deployment")}
    for kind, doc in base.items():
        assert _one(docs, kind, doc["metadata"]["name"]) == doc


def test_namespaced_command_line_watches_exactly_the_namespaces_that_have_a_role() -> None:
    docs = render("namespaced")
    deployment = _one(docs, "Deployment", "ember-operator")
    container = _container(deployment)
    assert container["args"] == NAMESPACED_ARGS
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert (args.command, args.all_namespaces, args.namespace) == ("operator", False, [WATCHED])
    assert (args.standalone, args.peering) == (True, None)
    roles = {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"}
    assert roles == bindings == set(args.namespace)
    base = _one(render("."), "Deployment", "ember-operator")
    base_container = _container(base)
    assert {k: v for k, v in container.items() if k != "args"} == {
        k: v for k, v in base_container.items() if k != "args"
    }


def test_argocd_cm_patch_merges_into_an_existing_argocd_cm(tmp_path: Path) -> None:
    existing = tmp_path / "argocd-cm.yaml"
    existing.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "argocd-cm", "namespace": "argocd"},
                "data": {"url": "https://argocd.example.com"},
            }
        )
    )
    patch = MANIFESTS / "argocd" / "argocd-cm-patch.yaml"
    merged = yaml.safe_load(
        _run("patch", "--local", "-f", str(existing), "--patch-file", str(patch), "-o", "yaml")
    )
    script = (MANIFESTS / "argocd" / "health.lua").read_text()
    assert merged["data"] == {
        "url": "https://argocd.example.com",
        "resource.customizations.health.ember.dev_InferenceService": script,
    }


def test_monitoring_overlay_ships_the_monitors_the_rules_and_the_dashboard() -> None:
    docs = render("monitoring")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "ember-grafana-dashboard"),
        ("PodMonitor", "ember-engines"),
        ("PodMonitor", "ember-routers"),
        ("PrometheusRule", "ember"),
        ("ServiceMonitor", "ember-operator"),
    ]
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ember"
    dashboard = _one(docs, "ConfigMap", "ember-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar picks up
    assert json.loads(dashboard["data"]["ember.json"]) == json.loads(
        (MANIFESTS / "monitoring" / "dashboard.json").read_text()
    )
    # The ServiceMonitor selects the operator's metrics Service, by a label and a port it has.
    service = _one(render("."), "Service", "ember-operator-metrics")
    monitor = _one(docs, "ServiceMonitor", "ember-operator")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
