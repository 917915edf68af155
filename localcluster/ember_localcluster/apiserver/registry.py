"""Which resource types are served right now: the built-ins plus whatever CRDs are established.

Creating a CRD registers its served versions at once (discoverable at `/apis/G/V` on the next request,
which is what kopf's CRD observer rescans for); updating it re-registers them, so a changed schema or
printer column applies to the next write; deleting it unregisters them.
"""

from __future__ import annotations

from .builtin import BUILTIN_TYPES
from .resources import ResourceType, crd_resource_types


class Registry:
    def __init__(self) -> None:
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        for rtype in BUILTIN_TYPES:
            self._add(rtype)

    def _add(self, rtype: ResourceType) -> None:
        self.types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        return next((t for t in self.types.values() if t.api_version == api_version and t.kind == kind), None)

    def by_storage(self, storage: tuple[str, str]) -> ResourceType | None:
        return next((t for t in self.types.values() if t.storage == storage), None)

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [t for t in self.types.values() if t.group == group and t.version == version]

    def group_versions(self) -> dict[str, list[str]]:
        """Group name → served versions, in registration order; the core group is ''."""
        groups: dict[str, list[str]] = {}
        for rtype in self.types.values():
            versions = groups.setdefault(rtype.group, [])
            if rtype.version not in versions:
                versions.append(rtype.version)
        return groups

    def register_crd(self, crd: dict) -> None:
        new = crd_resource_types(crd)
        if new:
            self.unregister(new[0].storage)
        for rtype in new:
            self._add(rtype)

    def unregister(self, storage: tuple[str, str]) -> None:
        for key, rtype in list(self.types.items()):
            if rtype.storage == storage and rtype.custom:
                del self.types[key]
