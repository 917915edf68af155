"""The kopf handlers: one level-triggered reconcile pass, run on create, update, resume, a timer tick, and
at once when one of its engine pods stops or starts being Ready (so a failed active pod is replaced by a
warm one without waiting for the tick).

A pass reads the InferenceService and its pods (from the pod watch's index, `podcache`), asks the pure parts what should be (`desired`, `rollout`,
`autoscaler` through `scaling`, `status`), makes the children match, and writes status. Nothing is
remembered that cannot be re-derived: the autoscaler's target and decisions are restored from status
after a restart.

An idle InferenceService costs the API server nothing per pass: pods come from the watch, children are
read again only when what they should be changes or at a resync (`known`), and status is patched only with
the fields that changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from ember_operator import metrics, podcache, router
from ember_operator.desired import (
    ACTIVE,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    ROLE_LABEL,
    WARM,
    Owner,
    active_selector,
    desired_pdb,
    desired_pod,
    desired_policy_configmap,
    desired_service,
    selector_string,
    service_endpoint,
    template_hash,
)
from ember_operator.groups import (
    LWS_GROUP,
    LWS_VERSION,
    desired_group,
    group_key,
    group_selector,
    instance_of,
)
from ember_operator.known import Known
from ember_operator.kube import Kube, NameConflict, load_balancer_address, new_api_client
from ember_operator.podcache import INDEX, index_pod, indexed_names
from ember_operator.podpatch import PodTemplateError
from ember_operator.pods import (
    Trouble,
    cold_start_seconds,
    held_troubles,
    is_ready,
    preempting,
    trouble,
    waiting_for_capacity,
)
from ember_operator.rollout import PodPlan, applied, plan_pods, roll_frees_room
from ember_operator.scaling import Memory, autoscale, record, woken
from ember_operator.scrape import Scraper
from ember_operator.spec import GROUP, PLURAL, VERSION, InferenceServiceSpec
from ember_operator.standby import PEERING_GROUP, PEERING_VERSION, Standby
from ember_operator.status import Assessment, Condition, render_conditions
from ember_operator.units import CRASH_HOLD_ANNOTATION, CrashLog, Units, collect_units, owned_by, same_hold


@dataclass(slots=True)
class Settings:
    tick: float = 2.0  # seconds between reconcile passes of one InferenceService
    cluster_domain: str = "cluster.local"
    scrape_timeout: float = 2.0
    resync: float = 60.0  # seconds between reads of children whose desired state has not changed


def _now() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._kube: Kube | None = None
        self._memories: dict[str, Memory] = {}  # by InferenceService uid
        self._pod_ready: dict[str, bool] = {}  # by pod uid: readiness last seen
        self._gone: set[str] = set()  # uids of InferenceServices seen deleted
        self._crashes = CrashLog()  # crashes of multi-node groups' pods
        self._ghosts: set[str] = set()  # uids of pods deleted that kopf's index still holds (`podcache`)
        self._scraper = Scraper(settings.scrape_timeout)
        self._namespaces: set[str] = set()  # of the InferenceServices seen: where namespaced peerings are
        self._standby: Standby | None = None  # with peering: whether a peer works meanwhile
        self._standby_task: asyncio.Task[None] | None = None

    def _memory(self, uid: str, status: dict[str, Any]) -> Memory:
        memory = self._memories.get(uid)
        if memory is None:
            memory = self._memories[uid] = Memory.restored(status)
        return memory

    async def kube(self) -> Kube:
        if self._kube is None:
            self._kube = Kube(await asyncio.to_thread(new_api_client))
        return self._kube

    async def handle(
        self,
        body: kopf.Body,
        spec: kopf.Spec,
        meta: kopf.Meta,
        status: kopf.Status,
        patch: kopf.Patch,
        **kwargs: Any,
    ) -> None:
        name, namespace = meta["name"], meta["namespace"]
        self._namespaces.add(namespace)
        if meta["uid"] in self._gone or meta.get("deletionTimestamp"):
            return  # a tick that raced the deletion: its children are being garbage-collected
        memory = self._memory(meta["uid"], dict(status))
        async with memory.lock:  # the timer, the change handlers and pod events may overlap
            try:
                await self._pass(body, dict(spec), meta, dict(status), patch, memory, kwargs.get(INDEX))
            except ApiException as e:
                metrics.RECONCILES.labels(namespace, name, "error").inc()
                raise kopf.TemporaryError(
                    f"API error {e.status}: {e.reason}", delay=self.settings.tick
                ) from e
        changed = only_changes(dict(patch.pop("status", None) or {}), dict(status))
        if changed:
            patch.status.update(changed)
        metrics.RECONCILES.labels(namespace, name, "ok").inc()

    async def cleanup(self, **_: Any) -> None:
        if self._standby_task is not None:
            self._standby_task.cancel()
        await self._scraper.close()

    async def startup(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        """With peering, follow whether a peer works while this replica stands by (`standby.py`)."""
        peering = settings.peering
        if peering.standalone or not peering.name:
            return
        custom = (await self.kube()).custom
        selector = f"metadata.name={peering.name}"

        def list_peerings(namespace: str | None) -> list[dict[str, Any]]:
            if namespace is None:
                found = custom.list_cluster_custom_object(
                    PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings", field_selector=selector
                )
            else:
                found = custom.list_namespaced_custom_object(
                    PEERING_GROUP, PEERING_VERSION, namespace, "kopfpeerings", field_selector=selector
                )
            return list(found.get("items") or [])

        interval = 5 * self.settings.tick
        self._standby = Standby(list_peerings, peering.name, peering.priority, interval, self._stand_by)
        clusterwide = peering.clusterwide

        def where() -> Sequence[str | None]:
            return [None] if clusterwide else sorted(self._namespaces)

        self._standby_task = asyncio.create_task(self._standby.run(where))

    def _stand_by(self) -> None:
        """A peer works: publish nothing (its gauges are the ones that count), and take up status afresh
        once this replica works again."""
        metrics.forget_all()
        for memory in self._memories.values():
            memory.stale = memory.relist = True

    async def resource_event(self, event: kopf.RawEvent, meta: kopf.Meta, **_: Any) -> None:
        """Forget an InferenceService's memory once it is gone; and the address of it that the services
        naming it as their fallback hold, once it is gone or has moved."""
        gone = event.get("type") == "DELETED"
        memory = self._memories.get(meta.get("uid", ""))
        if event.get("type") is None and memory is not None:  # listed again: after a pause, say
            memory.stale = memory.relist = True
        published = ((event.get("object") or {}).get("status") or {}).get("endpoint")
        for memory in self._memories.values():
            memory.known.drop("fallback", meta.get("name", ""), unless=None if gone else published)
        if gone:
            self._memories.pop(meta.get("uid", ""), None)
            self._gone.add(meta.get("uid", ""))
            metrics.forget(meta.get("namespace", ""), meta.get("name", ""))

    async def child_event(self, body: kopf.Body, **_: Any) -> None:
        """A child the passes make sure of (the Service, the policy ConfigMap, the budget, the routers'
        objects) was made, changed or deleted: its owner's next pass reads it again (and puts it back if
        someone else changed it) instead of trusting what it made sure of until the resync."""
        meta = body.get("metadata") or {}
        for ref in meta.get("ownerReferences") or []:
            memory = self._memories.get(ref.get("uid", "")) if ref.get("kind") == "InferenceService" else None
            if memory is not None:
                memory.known.forget_key(f"{body.get('kind')}/{meta.get('name')}")

    async def pod_event(self, event: kopf.RawEvent, body: kopf.Body, **kwargs: Any) -> None:
        """A pod of an InferenceService changed: when its readiness flipped (or it is gone), run the owner's
        pass now rather than at the next tick."""
        meta = body.get("metadata") or {}
        uid = meta.get("uid", "")
        self._crashes.record(dict(body))
        ready = is_ready(dict(body))
        if event.get("type") is None:  # the watch listed the pods again: the index may keep deleted ones
            for memory in self._memories.values():
                memory.relist = True
        if event.get("type") == "DELETED":
            self._pod_ready.pop(uid, None)
            self._ghosts.discard(uid)
        elif self._pod_ready.get(uid) == ready:
            return
        else:
            first_sight = uid not in self._pod_ready
            self._pod_ready[uid] = ready
            if first_sight and ready:
                return  # nothing changed that a pass would act on (e.g. the operator started)
        owner = next(
            (r for r in meta.get("ownerReferences") or [] if r.get("kind") == "InferenceService"), None
        )
        if owner is None and group_key(dict(body)) is not None:
            # A group's pods belong to its LeaderWorkerSet: their instance label names the service.
            owner = {"name": instance_of(dict(body)), "uid": None}
        expected = None if owner is None else owner.get("uid")  # None: any uid of that name
        if (
            owner is None
            or expected in self._gone
            or (expected is not None and expected not in self._memories)
        ):
            return
        kube = await self.kube()
        obj = await asyncio.to_thread(kube.get_inference_service, meta.get("namespace", ""), owner["name"])
        owner_uid = None if obj is None else obj["metadata"].get("uid")
        if (
            obj is None
            or owner_uid not in self._memories
            or expected not in (None, owner_uid)
            or obj["metadata"].get("deletionTimestamp")
        ):
            return
        memory = self._memory(owner_uid, obj.get("status") or {})
        patch = kopf.Patch()
        async with memory.lock:
            owner_body = kopf.Body(obj)  # type: ignore[arg-type]
            status = obj.get("status") or {}
            await self._pass(
                owner_body, obj.get("spec") or {}, owner_body.meta, status, patch, memory, kwargs.get(INDEX)
            )
        changed = only_changes(dict(patch.status), status)
        if changed:
            await asyncio.to_thread(kube.patch_status, obj["metadata"]["namespace"], owner["name"], changed)

    async def _pass(
        self,
        body: kopf.Body,
        raw_spec: dict[str, Any],
        meta: kopf.Meta,
        status: dict[str, Any],
        patch: kopf.Patch,
        memory: Memory,
        pod_index: Any,
    ) -> None:
        name, namespace = meta["name"], meta["namespace"]
        generation = int(meta.get("generation") or 0)
        now = _now()
        troubles: list[Trouble] = []
        if memory.stale:  # listed again (a replica resuming): take up status first, as one starting now
            memory.reset(status)
            memory.relist = True
        try:
            spec = InferenceServiceSpec.model_validate(raw_spec)
            memory.last_spec = spec
            record_spec_taken(raw_spec, meta, patch)
        except ValidationError as e:  # only without the CRD's own validation (an old or edited CRD)
            problem = Trouble("InvalidSpec", "; ".join(err["msg"] for err in e.errors()))
            if memory.last_spec is None:  # none taken since the operator started: the one an earlier took
                memory.last_spec = spec_taken_before(meta)
            if memory.last_spec is None:  # no spec taken yet: nothing to run
                self._stalled_event(body, memory, [problem])
                condition = Condition("Stalled", True, problem.reason, problem.message)
                patch.status["observedGeneration"] = generation
                patch.status["conditions"] = memory.conditions = render_conditions(
                    [condition, Condition("Reconciling", False, "Stalled")],
                    memory.conditions,
                    generation,
                    now,
                )
                return
            # The service keeps running on the last spec taken (failover, replacement, scaling), and the
            # refusal is reported with whatever else is wrong.
            spec = memory.last_spec
            troubles.append(problem)

        owner = Owner(name, namespace, meta["uid"])
        kube = await self.kube()
        memory.known.begin(self.settings.resync)
        fallback_url = await self._fallback_url(kube, spec, owner, troubles, memory.known)
        route_urls = await self._routing_urls(kube, spec, owner, troubles)
        cm = desired_policy_configmap(owner, spec, fallback_url, router.routes_document(spec, route_urls))
        await self._ensure(kube, cm, ("data",), troubles, memory.known)
        selector = router.service_selector(name, spec)
        service = await self._ensure(
            kube, desired_service(owner, selector), ("spec",), troubles, memory.known
        )
        routers = await self._routers(
            kube, owner, spec, troubles, status.get("router") is not None, memory.known
        )

        pods_of = await self._pods_of(kube, pod_index, namespace, name, memory, status)
        listed = memory.pending.pods(pods_of(None))
        groups: list[dict[str, Any]] | None = []
        if spec.resources.nodes > 1 or memory.has_groups is not False:
            # Listed while there are any (or may be): a pass with nodes 1 retires the groups left over.
            groups = await asyncio.to_thread(kube.list_groups, namespace, group_selector(name))
            memory.has_groups = bool(groups)
        units = collect_units(owner.uid, listed, groups or [], now, spec.capacity_wait_seconds)
        for g in groups or []:  # the holds an operator before this one kept (a restart)
            self._crashes.restore(g, time.monotonic(), time.time())
        for p in listed:
            self._crashes.record(p)
        views = units.views

        router_pages = router.router_metrics_targets(pods_of(router.ROUTER))
        await autoscale(
            body,
            spec,
            owner,
            units.serving,
            views,
            memory,
            now,
            self._scraper,
            router_pages,
            lambda: pods_of(None),
        )
        assert memory.desired is not None
        if router.asleep(spec, memory.desired):
            await self._wake(body, spec, owner, memory, now, router_pages)
        pod_hash = template_hash(spec)
        plan = plan_pods(
            views,
            pod_hash,
            memory.desired,
            spec.warm_pool.size,
            now,
            spec.warm_pool.failover_after_seconds,
            spec.rollout.max_surge,
            spec.rollout.max_unavailable,
            memory.releases.observe((v.name for v in views), time.monotonic()),
        )
        if groups is None and spec.resources.nodes > 1:
            # Nothing changes until the API is there: a roll from pods to groups would only take pods away.
            plan = PodPlan()
            troubles.append(
                Trouble(
                    "LeaderWorkerSetMissing",
                    f"resources.nodes is {spec.resources.nodes}, but the cluster does not serve the "
                    f"LeaderWorkerSet API ({LWS_GROUP}/{LWS_VERSION}): install the LeaderWorkerSet controller",
                )
            )
        await self._ensure(kube, desired_pdb(owner, spec, memory.desired), ("spec",), troubles, memory.known)
        crash_loops = self._crashes.troubles(namespace, name, units, time.monotonic())
        await self._put_back_groups(kube, owner, groups or [])
        try:
            desired_pod(owner, spec, WARM, pod_hash)
        except PodTemplateError as e:  # no pod can be made: leave the ones there are as they are
            troubles.append(Trouble("PodTemplateInvalid", str(e)))
            carried_out = False
        else:
            await self._mirror_group_roles(kube, namespace, units, memory)
            troubles += await self._apply(body, kube, owner, spec, pod_hash, plan, memory, units)
            carried_out = True
        wait = spec.capacity_wait_seconds
        current = [
            p for v in views if v.template_hash == pod_hash and not v.deleting for p in units.pods_of[v.name]
        ]
        # The capacity wait runs from the later of a pod's own wait and the last room freed; not while a roll
        # frees room (a large model's load can outlast capacityWaitSeconds, one step of the roll).
        floor = now if roll_frees_room(views, pod_hash) else memory.releases.at(now)
        found = {p["metadata"]["name"]: t for p in current if (t := trouble(p, now, wait, floor))}
        troubles += held_troubles(memory.held, current, found, now)
        troubles += crash_loops
        waiting = [m for p in units.all_pods() if (m := waiting_for_capacity(p, now, wait, floor))]
        # Router pods no node can take: waiting for capacity, then trouble, as engine pods are.
        router_pods = [p for p in pods_of(router.ROUTER) if not p["metadata"].get("deletionTimestamp")]
        waiting += [m for p in router_pods if (m := waiting_for_capacity(p, now, wait))]
        nominated = [m for p in [*units.all_pods(), *router_pods] if (m := preempting(p, now, wait))]
        found = {p["metadata"]["name"]: t for p in router_pods if (t := trouble(p, now, wait))}
        troubles += held_troubles(memory.router_held, router_pods, found, now)
        self._stalled_event(body, memory, troubles)

        for p, v in sorted(zip(units.serving, views, strict=True), key=lambda pv: pv[1].created):
            seconds = cold_start_seconds(p)
            if seconds is not None and v.template_hash == pod_hash:
                memory.cold_start = round(seconds, 3)

        router_state = router.router_status(spec, routers)
        assessment = Assessment(
            template_hash=pod_hash,
            desired_active=memory.desired,
            warm_size=spec.warm_pool.size,
            min_replicas=spec.replicas.min,
            # As this pass left them: a warm pod promoted in a lost active pod's place serves already.
            pods=applied(views, plan) if carried_out else views,
            plan=plan,
            troubles=troubles,
            metrics=memory.metrics,
            fallback=memory.fallback,
            waiting_for_capacity=waiting,
            preempting=nominated,
            routers=None if router_state is None else (router_state["ready"], router_state["desired"]),
        )
        patch.status.update(assessment.counts())
        patch.status["observedGeneration"] = generation
        patch.status["selector"] = selector_string(active_selector(name))
        published = load_balancer_address(service) if service is not None else None
        patch.status["endpoint"] = (
            f"http://{published}"
            if published
            else service_endpoint(name, namespace, self.settings.cluster_domain)
        )
        patch.status["coldStartSeconds"] = memory.cold_start
        patch.status["autoscaler"] = {"inputs": memory.inputs, "decisions": memory.decisions}
        patch.status["router"] = router_state
        conditions = [*assessment.conditions(), router.router_condition(spec, router_state)]
        patch.status["conditions"] = memory.conditions = render_conditions(
            conditions, memory.conditions, generation, now
        )
        if self._standby is None or not self._standby.paused:  # a pass that ran on into a pause
            metrics.DESIRED.labels(namespace, name).set(memory.desired)
            metrics.publish_status(namespace, name, dict(patch.status))

    async def _pods_of(
        self, kube: Kube, pod_index: Any, namespace: str, name: str, memory: Memory, status: dict[str, Any]
    ) -> Callable[[str | None], list[dict[str, Any]]]:
        """The service's pods by role (None: engines), for one pass: from kopf's index, less the pods it
        holds that are gone; after the watch listed again, from a LIST of this pass's own."""
        if self._ghosts:  # a ghost the index dropped (its DELETED event came after all) is forgotten
            self._ghosts &= podcache.held_uids(pod_index or {})
        if not memory.relist:
            ghosts = frozenset(self._ghosts)
            return lambda role: podcache.indexed(pod_index, namespace, name, role, ghosts)
        held = podcache.held(pod_index, namespace, name)  # before the LIST: a pod made after it is no ghost
        listed = await asyncio.to_thread(kube.list_pods, namespace, podcache.SELECTOR)
        gone = podcache.ghosts(held, listed)
        self._ghosts |= gone
        for uid in gone:
            self._pod_ready.pop(uid, None)
        memory.relist = False
        return lambda role: podcache.as_indexed(listed, namespace, name, role)

    async def _fallback_url(
        self, kube: Kube, spec: InferenceServiceSpec, owner: Owner, troubles: list[Trouble], known: Known
    ) -> str | None:
        f = spec.fallback
        if f is None:
            return None
        if f.url is not None:
            return f.url
        assert f.service is not None
        if f.service == owner.name:
            troubles.append(Trouble("FallbackInvalid", "fallback.service names this InferenceService itself"))
            return None
        seen, endpoint = known.get("fallback", f.service)
        if seen:
            return str(endpoint)
        other = await asyncio.to_thread(kube.get_inference_service, owner.namespace, f.service)
        if other is None:
            troubles.append(
                Trouble(
                    "FallbackInvalid",
                    f"fallback.service {f.service!r}: no InferenceService of that name in {owner.namespace}",
                )
            )
            return None
        published = (other.get("status") or {}).get("endpoint")
        endpoint = published or service_endpoint(f.service, owner.namespace, self.settings.cluster_domain)
        # Settled once the fallback publishes an address of its own; until then read again soon.
        internal = service_endpoint(f.service, owner.namespace, self.settings.cluster_domain)
        known.put("fallback", f.service, endpoint, settled=bool(published) and published != internal)
        return str(endpoint)

    async def _apply(
        self,
        body: kopf.Body,
        kube: Kube,
        owner: Owner,
        spec: InferenceServiceSpec,
        pod_hash: str,
        plan: PodPlan,
        memory: Memory,
        units: Units,
    ) -> list[Trouble]:
        """Carry out a pod plan (each unit a pod or a group): promotions first (capacity at once), then
        creations, then retirements. After a refused creation, creations back off (2 s doubling to 60 s)
        and the refusal stays reported."""
        ns, name = owner.namespace, owner.name
        troubles: list[Trouble] = []
        replaced = dict((warm, failed) for failed, warm in plan.failovers)
        for pod in plan.promote:
            await self._set_role(kube, ns, pod, ACTIVE, units, memory)
            metrics.POD_CHANGES.labels(ns, name, "promoted").inc()
            if pod in replaced:
                kopf.warn(
                    body,
                    reason="FailedOver",
                    message=f"active pod {replaced[pod]} stopped serving; warm pod {pod} took its place",
                )
            else:
                kopf.info(body, reason="Promoted", message=f"warm pod {pod} now serves traffic")
        for pod in plan.demote:
            await self._set_role(kube, ns, pod, WARM, units, memory)
            metrics.POD_CHANGES.labels(ns, name, "demoted").inc()
            kopf.info(body, reason="Demoted", message=f"pod {pod} returned to the warm pool")
        backing_off = memory.create_refused is not None and time.monotonic() < memory.create_retry_at
        if plan.create_warm and backing_off:
            troubles.append(memory.create_refused)
        for _ in range(0 if backing_off else plan.create_warm):
            try:
                if spec.resources.nodes > 1:
                    await asyncio.to_thread(kube.create_group, desired_group(owner, spec, WARM, pod_hash))
                else:
                    created = await asyncio.to_thread(
                        kube.create_pod, desired_pod(owner, spec, WARM, pod_hash)
                    )
                    memory.pending.wrote(created)
            except ApiException as e:
                refused = refusal(e, "an engine group" if spec.resources.nodes > 1 else "an engine pod")
                if refused is None:
                    raise
                # The rest of the plan still runs; creations wait out the back-off.
                troubles.append(refused)
                memory.create_refused = refused
                memory.create_backoff = min(60.0, max(2.0, memory.create_backoff * 2))
                memory.create_retry_at = time.monotonic() + memory.create_backoff
                break
            memory.create_refused, memory.create_backoff = None, 0.0
            metrics.POD_CHANGES.labels(ns, name, "created").inc()
        for pod in plan.delete:
            await asyncio.to_thread(kube.delete_group if units.is_group(pod) else kube.delete_pod, ns, pod)
            if not units.is_group(pod):
                memory.pending.deleted(pod)
            metrics.POD_CHANGES.labels(ns, name, "deleted").inc()
        return troubles

    async def _set_role(
        self, kube: Kube, namespace: str, unit: str, role: str, units: Units, memory: Memory
    ) -> None:
        """A pod's role label; a group's on the LeaderWorkerSet and on its leader (what the Service selects)."""
        if not units.is_group(unit):
            memory.pending.wrote(
                await asyncio.to_thread(kube.relabel_pod, namespace, unit, {ROLE_LABEL: role})
            )
            return
        await asyncio.to_thread(kube.relabel_group, namespace, unit, {ROLE_LABEL: role})
        leader = units.leaders.get(unit)
        if leader is not None:
            memory.pending.wrote(
                await asyncio.to_thread(
                    kube.relabel_pod, namespace, leader["metadata"]["name"], {ROLE_LABEL: role}
                )
            )

    async def _put_back_groups(self, kube: Kube, owner: Owner, groups: list[dict[str, Any]]) -> None:
        """Each group's LeaderWorkerSet at the one group the operator asks for, or at none while the group is
        held back for crash-looping: a set someone scaled is put back, as a Deployment puts back its
        ReplicaSet. (Its pod templates are left as they are: a changed template rolls a group, and an
        operator upgrade must roll none.)"""
        for g in groups:
            meta = g["metadata"]
            if not owned_by(g, owner.uid) or meta.get("deletionTimestamp"):
                continue
            wanted = 0 if self._crashes.held(owner.namespace, meta["name"]) else 1
            hold = self._crashes.annotation(owner.namespace, meta["name"], time.monotonic(), time.time())
            kept = (meta.get("annotations") or {}).get(CRASH_HOLD_ANNOTATION)
            # The hold's end is written once per hold: it moves by rounding only, between passes.
            hold_changed = not same_hold(hold, kept)
            if (g.get("spec") or {}).get("replicas", 1) != wanted or hold_changed:
                await asyncio.to_thread(
                    kube.scale_group,
                    owner.namespace,
                    meta["name"],
                    wanted,
                    {CRASH_HOLD_ANNOTATION: hold} if hold_changed else None,
                )

    async def _mirror_group_roles(self, kube: Kube, namespace: str, units: Units, memory: Memory) -> None:
        """A recreated group's new leader starts with its template's role: give it the group's."""
        for v in units.views:
            leader = units.leaders.get(v.name)
            if leader is None or leader["metadata"].get("deletionTimestamp"):
                continue
            if (leader["metadata"].get("labels") or {}).get(ROLE_LABEL) != v.role:
                memory.pending.wrote(
                    await asyncio.to_thread(
                        kube.relabel_pod, namespace, leader["metadata"]["name"], {ROLE_LABEL: v.role}
                    )
                )

    async def _routers(
        self,
        kube: Kube,
        owner: Owner,
        spec: InferenceServiceSpec,
        troubles: list[Trouble],
        had: bool,
        known: Known,
    ) -> dict[str, Any] | None:
        """Make the router's objects match (or, when it is off and status still shows one (`had`), delete
        them); returns its Deployment."""
        deployment = None
        for obj in router.desired_objects(owner, spec):
            deployment = await self._ensure(kube, obj, router.ENSURED_FIELDS[obj["kind"]], troubles, known)
        if not spec.router.enabled and had:
            name = router.router_name(owner.name)
            for kind in router.KINDS:
                await asyncio.to_thread(kube.delete_owned, kind, owner.namespace, name, owner.uid)
        return deployment

    async def _routing_urls(
        self, kube: Kube, spec: InferenceServiceSpec, owner: Owner, troubles: list[Trouble]
    ) -> dict[str, str]:
        """The address of each InferenceService spec.routing names that exists (RoutingInvalid names
        the rest)."""
        urls: dict[str, str] = {}
        for name in {r.service for r in spec.routing} - {owner.name}:
            other = await asyncio.to_thread(kube.get_inference_service, owner.namespace, name)
            if other is not None:
                endpoint = (other.get("status") or {}).get("endpoint")
                urls[name] = endpoint or service_endpoint(name, owner.namespace, self.settings.cluster_domain)
        problem = router.routing_problem(spec, owner, {n: True for n in urls})
        if problem is not None:
            troubles.append(Trouble("RoutingInvalid", problem))
        return urls

    async def _wake(
        self,
        body: kopf.Body,
        spec: InferenceServiceSpec,
        owner: Owner,
        memory: Memory,
        now: datetime,
        router_pages: dict[str, str],
    ) -> None:
        """Scale from zero: read what the routers (their /metrics by pod name, from the pod index) hold,
        and raise the target to 1 if they hold anything."""
        pending = await self._scraper.pending(list(router_pages.values()))
        decision = woken(spec, memory, pending, time.monotonic())
        if decision is not None:
            record(body, owner, memory, decision, now)

    async def _ensure(
        self,
        kube: Kube,
        desired: dict[str, Any],
        fields: tuple[str, ...],
        troubles: list[Trouble],
        known: Known,
    ) -> dict[str, Any] | None:
        """`kube.ensure` unless the same object was made sure of since the last resync, with a foreign object
        of the name or a refusal reported as trouble (and not remembered: the next pass tries again)."""
        key = f"{desired['kind']}/{desired['metadata']['name']}"
        seen, actual = known.get(key, desired)
        if seen:
            return dict(actual)
        try:
            actual = await asyncio.to_thread(kube.ensure, desired, fields)
            known.put(key, desired, actual, settled=_settled(desired["kind"], actual))
            return dict(actual)
        except NameConflict as e:
            troubles.append(Trouble("NameConflict", str(e)))
        except ApiException as e:
            refused = refusal(e, f"the {desired['kind']} {desired['metadata']['name']}")
            if refused is None:
                raise
            troubles.append(refused)
        return None

    def _stalled_event(self, body: kopf.Body, memory: Memory, troubles: list[Trouble]) -> None:
        message = "; ".join(t.message for t in troubles) or None
        if message == memory.stalled:
            return
        if message is not None:
            kopf.warn(body, reason=troubles[0].reason, message=message)
        elif memory.stalled is not None:
            kopf.info(body, reason="Recovered", message="no longer stalled")
        memory.stalled = message


# The spec the operator last took, as the object's own annotation (as kubectl and kopf keep theirs): an
# operator that starts while the stored spec is one its model refuses runs the service on it. Whoever
# can write it can write the spec itself. Too large a spec is not kept (annotations share 256 KiB).
SPEC_TAKEN = "ember.dev/spec-taken"
SPEC_TAKEN_LIMIT = 64 * 1024


def record_spec_taken(raw_spec: dict[str, Any], meta: kopf.Meta, patch: kopf.Patch) -> None:
    taken = json.dumps(raw_spec, sort_keys=True, separators=(",", ":"))
    if len(taken) <= SPEC_TAKEN_LIMIT and (meta.get("annotations") or {}).get(SPEC_TAKEN) != taken:
        patch.meta.annotations[SPEC_TAKEN] = taken


def spec_taken_before(meta: kopf.Meta) -> InferenceServiceSpec | None:
    """The spec an operator took last, if it is there and this operator's model takes it."""
    taken = (meta.get("annotations") or {}).get(SPEC_TAKEN)
    if taken is None:
        return None
    try:
        return InferenceServiceSpec.model_validate(json.loads(taken))
    except ValueError:  # not JSON, or a spec this operator's model refuses too (a ValidationError)
        return None


def only_changes(status: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The fields of a pass's `status` whose value differs from what the object's status has now. A null
    removes its key (a merge patch), so it is compared as the key absent."""
    return {k: v for k, v in status.items() if current.get(k) != _without_nulls(v)}


def _without_nulls(value: Any) -> Any:
    """`value` as the API server stores it: keys whose value is null removed, at every depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def refusal(e: ApiException, what: str) -> Trouble | None:
    """A refusal that only a change (to the spec, a quota, the namespace's policy) can lift, as trouble;
    None for errors worth retrying as they are."""
    message = _message(e)
    if e.status == 403:
        if "exceeded quota" in message:
            reason = "QuotaExceeded"
        elif "violates PodSecurity" in message:
            reason = "PodSecurityRejected"
        else:
            reason = "Forbidden"
        return Trouble(reason, f"the API server refused {what}: {message}")
    if e.status in (400, 422):
        return Trouble("PodRejected", f"the API server refused {what}: {message}")
    return None


def _message(e: ApiException) -> str:
    """The Kubernetes Status message of an API error, or its HTTP reason."""
    try:
        return str(json.loads(e.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"


# What `_ensure` makes sure of, watched (group, version, plural) so that an edit or deletion by someone else
# is put back at the next pass; each watch needs list and watch on its kind (manifests/base/rbac.yaml).
CHILDREN = (
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
)


def register(registry: kopf.OperatorRegistry, settings: Settings) -> Reconciler:
    """Register the handlers for InferenceServices in `registry`."""
    reconciler = Reconciler(settings)
    backoff = settings.tick
    resource = (GROUP, VERSION, PLURAL)
    kopf.on.resume(*resource, id="reconcile-resume", backoff=backoff, registry=registry)(reconciler.handle)
    kopf.on.create(*resource, id="reconcile-create", backoff=backoff, registry=registry)(reconciler.handle)
    kopf.on.update(*resource, id="reconcile-update", backoff=backoff, registry=registry)(reconciler.handle)
    kopf.timer(*resource, id="reconcile-tick", interval=settings.tick, backoff=backoff, registry=registry)(
        reconciler.handle
    )
    kopf.on.event("v1", "pods", labels={MANAGED_BY_LABEL: "ember-operator"}, registry=registry)(
        reconciler.pod_event
    )
    for child in CHILDREN:
        kopf.on.event(*child, labels={MANAGED_BY_LABEL: "ember-operator"}, registry=registry)(
            reconciler.child_event
        )
    # Filled from the same pod watch; kopf starts no other handler before its first listing is in.
    kopf.index("v1", "pods", id=INDEX, labels={NAME_LABEL: indexed_names}, registry=registry)(index_pod)
    kopf.on.event(*resource, registry=registry)(reconciler.resource_event)
    kopf.on.startup(registry=registry)(reconciler.startup)
    kopf.on.cleanup(registry=registry)(reconciler.cleanup)
    _no_finalizer_for(registry, "reconcile-tick")
    return reconciler


def _no_finalizer_for(registry: kopf.OperatorRegistry, handler_id: str) -> None:
    """kopf registers every timer as needing a finalizer (to stop it before the object goes), and no
    setting turns that off. Nothing here needs one: garbage collection removes the children, and a timer
    whose object is gone is stopped when kopf sees the deletion. A finalizer would only hold every
    deletion (and its namespace's) while the operator is down, so this timer is registered without."""
    spawning = getattr(getattr(registry, "_spawning", None), "_handlers", None)
    if not isinstance(spawning, list) or not any(getattr(h, "id", None) == handler_id for h in spawning):
        raise RuntimeError(f"kopf {kopf.__version__}: cannot find the timer {handler_id!r} in the registry")
    spawning[:] = [
        dataclasses.replace(h, requires_finalizer=False) if h.id == handler_id else h for h in spawning
    ]


def _settled(kind: str, actual: dict[str, Any]) -> bool:
    """Whether a child's status, as read, is what it will stay: a Service whose address is yet to be
    published, or a Deployment (the routers) whose pods are not all Ready, is read again soon."""
    if kind == "Service":
        return load_balancer_address(actual) is not None
    if kind == "Deployment":
        status = actual.get("status") or {}
        wanted = int((actual.get("spec") or {}).get("replicas") or 0)
        return int(status.get("readyReplicas") or 0) >= wanted
    return True
