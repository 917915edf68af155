"""An in-process Kubernetes API server for the local control plane and the operator's tests.

`APIServer` serves the REST API that kopf, the official `kubernetes` client and kubectl use, over plain
HTTP, from memory: discovery, CRUD with resourceVersion/generation semantics, the four patch types,
watches with bookmarks and 410s, finalizers, owner-reference garbage collection, status and scale
subresources, a pod's binding and log subresources, CRDs with schema pruning, defaulting and CEL
validation, and Table output for kubectl.
Each module's docstring says what it models and what it leaves out.
"""

from .errors import APIError
from .server import APIServer

__all__ = ["APIError", "APIServer"]
