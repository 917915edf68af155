"""The tests' one-off HTTP requests, through one client: `httpx.get` and its kin build a client per call,
and with it an SSL context, which parses the system's CA bundle (25-50 ms of CPU on the development
machine) even for a plain `http://` URL; a readiness poll every 50 ms spent about a core on that, beside
the server it waited for. This client is built once and otherwise behaves as those calls do: no connection
is kept between requests (each opens its own), httpx's default 5 s timeout, no redirects followed, the
environment's proxy settings honoured. `SSL_CONTEXT` is its context, for clients a test builds itself."""

from __future__ import annotations

import httpx

SSL_CONTEXT = httpx.create_ssl_context()
_CLIENT = httpx.Client(verify=SSL_CONTEXT, limits=httpx.Limits(max_keepalive_connections=0))

get = _CLIENT.get
post = _CLIENT.post
put = _CLIENT.put
stream = _CLIENT.stream
request = _CLIENT.request
