"""`ember operator`: run the InferenceService operator (kopf) until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random

DEFAULT_PEERING = "ember-operator"


def add_arguments(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)"
    )
    ha = p.add_mutually_exclusive_group()
    ha.add_argument(
        "--standalone", action="store_true", help="no peering: this is the only operator (the default)"
    )
    ha.add_argument(
        "--peering",
        metavar="NAME",
        help="run as one of several replicas; the one with the highest --priority is active "
        "(needs kopf's KopfPeering CRDs, see manifests/ha)",
    )
    p.add_argument(
        "--priority",
        type=int,
        help="peering priority, higher wins (default with --peering: drawn at random, because kopf pauses "
        "every replica while two share the highest priority)",
    )
    p.add_argument("--tick", type=float, default=2.0, help="seconds between reconcile passes (default 2)")
    p.add_argument("--cluster-domain", default="cluster.local", help="for the endpoint in status")
    p.add_argument("--scrape-timeout", type=float, default=2.0, help="seconds per engine /metrics scrape")
    p.add_argument(
        "--resync",
        type=float,
        default=60.0,
        help="seconds between reads of each Service, ConfigMap and PodDisruptionBudget whose desired state "
        "has not changed: how long someone else's edit to one can stand (default 60)",
    )
    p.add_argument("--health-port", type=int, default=8081, help="serves /healthz (0: off)")
    p.add_argument("--metrics-port", type=int, default=8080, help="serves Prometheus /metrics (0: off)")
    p.add_argument("--verbose", action="store_true")


def peering_priority(args: argparse.Namespace) -> int:
    if args.priority is not None:
        return int(args.priority)
    return random.SystemRandom().randint(1, 2**31 - 1) if args.peering is not None else 0


def operator_settings(args: argparse.Namespace):  # -> kopf.OperatorSettings
    import kopf

    settings = kopf.OperatorSettings()
    settings.peering.standalone = args.peering is None
    if args.peering is not None:
        settings.peering.name = args.peering
        settings.peering.mandatory = True
        settings.peering.priority = peering_priority(args)
    settings.posting.level = logging.INFO
    # Deleting an InferenceService stops its timer; the default 60 s poll would hold the deletion that long.
    settings.background.cancellation_polling = 1.0
    settings.persistence.finalizer = "ember.dev/operator"
    return settings


async def run(args: argparse.Namespace) -> None:
    import kopf

    from ember_operator import metrics
    from ember_operator.handlers import Settings, register

    registry = kopf.OperatorRegistry()
    register(registry, Settings(args.tick, args.cluster_domain, args.scrape_timeout, args.resync))
    if args.metrics_port:
        metrics.serve(args.metrics_port)

    # A registry of one's own starts empty: kopf's default login (through the kubernetes client's
    # in-cluster or kubeconfig settings) has to be added explicitly.
    kopf.on.login(registry=registry)(kopf.login_via_client)

    settings = operator_settings(args)
    await kopf.operator(
        registry=registry,
        settings=settings,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=settings.peering.priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
    )


def main(args: argparse.Namespace) -> int:
    import kopf

    kopf.configure(verbose=args.verbose, log_prefix=True)
    logging.getLogger("ember").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args))
    return 0
