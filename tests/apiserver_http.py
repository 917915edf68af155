"""Raw requests to the local API server, as a client that reads every answer (errors included) would."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ember_localcluster.apiserver import APIServer


def http(
    server: APIServer, method: str, path: str, body: Any = None, content_type: str = "application/json"
) -> tuple[int, dict[str, Any]]:
    """A raw request; (status code, decoded JSON body), errors included."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
