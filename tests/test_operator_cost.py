"""What keeps the operator cheap at fleet size: the pod index's expectations for the operator's own writes,
children made sure of until a resync, the scrape reading four series through one kept-open client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ember_operator import known as known_module
from ember_operator import podcache
from ember_operator.handlers import only_changes
from ember_operator.known import Known
from ember_operator.podcache import Pending
from ember_operator.scrape import Scraper, parse_sample


def pod(name: str, rv: str, role: str = "warm", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": rv, "labels": {"ember.dev/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta}


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def test_a_created_pod_counts_until_the_index_shows_it() -> None:
    pending = Pending()
    assert pending.pods([pod("a", "1")]) == [pod("a", "1")]
    pending.wrote(pod("b", "5"))
    assert names(pending.pods([pod("a", "1")])) == ["a", "b"]  # the watch has not delivered b yet
    assert pending.pods([pod("a", "1"), pod("b", "6")]) == [pod("a", "1"), pod("b", "6")]
    assert pending.writes == {}


def test_a_relabel_stands_until_the_indexed_copy_moves_on() -> None:
    pending = Pending()
    pending.pods([pod("a", "1")])
    pending.wrote(pod("a", "2", role="active"))
    assert pending.pods([pod("a", "1")]) == [pod("a", "2", role="active")]
    assert pending.pods([pod("a", "3", role="active")]) == [pod("a", "3", role="active")]
    assert pending.writes == {}


def test_a_deleted_pod_is_left_out_until_the_index_drops_it_or_shows_it_terminating() -> None:
    pending = Pending()
    pending.pods([pod("a", "1"), pod("b", "1")])
    pending.deleted("a")
    pending.deleted("b")
    assert names(pending.pods([pod("a", "1"), pod("b", "1")])) == []
    assert pending.pods([pod("b", "2", deleting=True)]) == [pod("b", "2", deleting=True)]
    assert pending.writes == {}


def test_an_expectation_the_watch_never_meets_lapses(monkeypatch: pytest.MonkeyPatch) -> None:
    pending = Pending()
    pending.wrote(pod("ghost", "9"))
    assert names(pending.pods([])) == ["ghost"]
    monkeypatch.setattr(podcache, "LAPSE", -1.0)
    assert pending.pods([]) == []


def test_the_index_files_ember_pods_by_namespace_and_instance() -> None:
    labels = {"app.kubernetes.io/name": "ember", "app.kubernetes.io/instance": "chat"}
    body = {"metadata": {"name": "chat-x", "labels": labels}}
    assert podcache.index_pod("ns", labels, body) == {("ns", "chat"): body}
    assert podcache.index_pod("ns", {"app.kubernetes.io/instance": "chat"}, body) is None
    assert podcache.indexed({("ns", "chat"): [body]}, "ns", "chat") == [body]
    assert podcache.indexed({}, "ns", "other") == []
    # Router pods (no instance label: nothing that selects engines sees them) under their own key.
    router_labels = {"app.kubernetes.io/name": "ember-router", "ember.dev/router": "chat"}
    router_body = {"metadata": {"name": "chat-router-x", "labels": router_labels}}
    assert podcache.index_pod("ns", router_labels, router_body) == {("ns", "chat", "router"): router_body}
    store = {("ns", "chat"): [body], ("ns", "chat", "router"): [router_body]}
    assert podcache.indexed(store, "ns", "chat") == [body]
    assert podcache.indexed(store, "ns", "chat", "router") == [router_body]
    assert podcache.indexed_names("ember") and podcache.indexed_names("ember-router")
    assert not podcache.indexed_names("other") and not podcache.indexed_names(None)


def test_known_holds_until_the_desired_object_changes_or_a_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(known_module.time, "monotonic", lambda: clock[0])
    known = Known()
    known.begin(60.0)
    desired = {"kind": "ConfigMap", "data": {"a": "1"}}
    assert known.get("cm", desired) == (False, None)
    known.put("cm", desired, "read")
    clock[0] += 30
    known.begin(60.0)
    assert known.get("cm", desired) == (True, "read")
    assert known.get("cm", {"kind": "ConfigMap", "data": {"a": "2"}}) == (False, None)
    clock[0] += 31
    known.begin(60.0)
    assert known.get("cm", desired) == (False, None)


def test_an_unsettled_result_is_read_again_after_1_2_4_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(known_module.time, "monotonic", lambda: clock[0])
    known = Known()
    known.begin(60.0)
    holds = []
    for _ in range(6):
        known.put("svc", {}, "unpublished", settled=False)
        start = clock[0]
        while known.get("svc", {})[0]:
            clock[0] += 0.5
        holds.append(clock[0] - start)
    assert holds == [1.0, 2.0, 4.0, 8.0, 16.0, 29.0]  # then until the resync, at 60 s
    known.begin(60.0)  # the resync
    known.put("svc", {}, "published")
    clock[0] += 30
    assert known.get("svc", {}) == (True, "published")


def test_only_changed_status_fields_are_patched() -> None:
    current = {"replicas": 2, "conditions": [{"type": "Ready", "status": "True"}], "endpoint": "x"}
    same = {"replicas": 2, "conditions": [{"type": "Ready", "status": "True"}], "endpoint": "x"}
    assert only_changes(same, current) == {}
    assert only_changes({**same, "replicas": 3, "coldStartSeconds": 1.5}, current) == {
        "replicas": 3,
        "coldStartSeconds": 1.5,
    }
    # A null removes its key in the merge patch: a reading no pod gave is no change from its absence.
    blind = {"inputs": {"queueDepth": None, "kvCacheUtilization": None, "readyPods": 0}, "decisions": []}
    unread = {**current, "autoscaler": {"inputs": {"readyPods": 0}, "decisions": []}}
    assert only_changes({**same, "autoscaler": blind, "coldStartSeconds": None}, unread) == {}
    read = {**current, "autoscaler": {"inputs": {"queueDepth": 7.0, "readyPods": 1}, "decisions": []}}
    assert only_changes({**same, "autoscaler": blind}, read) == {"autoscaler": blind}


def test_parse_sample_reads_only_its_series_among_others() -> None:
    page = "\n".join(
        [
            "# HELP vllm:num_requests_waiting Requests waiting.",
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{model_name="a b"} 3.0',
            'vllm:num_requests_waiting{model_name="c"} 1 1700000000000',
            'vllm:num_requests_waiting_seconds_bucket{le="+Inf"} 99',
            "vllm:num_requests_running 2",
            'vllm:kv_cache_usage_perc{model_name="a b"} 0.5',
            'ember:fallback_requests_total{outcome="served",model_name="m"} 4',
            'ember:fallback_requests_total{outcome="failed",model_name="m"} 7',
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 12',
        ]
    )
    sample = parse_sample(page)
    assert (sample.load.waiting, sample.load.running, sample.load.kv_cache) == (4, 2, 0.5)
    assert sample.fallback_served == 4


class _Counting(ThreadingHTTPServer):
    connections = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections += 1
        super().process_request(request, client_address)


@pytest.fixture
def engine_page() -> Iterator[_Counting]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = b"vllm:num_requests_waiting 1\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = _Counting(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_scrapes_reuse_one_open_connection_per_pod(engine_page: _Counting) -> None:
    base = f"http://127.0.0.1:{engine_page.server_address[1]}"

    async def three_scrapes() -> list[dict[str, Any]]:
        scraper = Scraper(timeout=2.0)
        try:
            return [await scraper.scrape({"p": f"{base}/metrics", "q": f"{base}/nope"}) for _ in range(3)]
        finally:
            await scraper.close()

    results = asyncio.run(three_scrapes())
    for r in results:
        assert r["p"].load.waiting == 1  # type: ignore[union-attr]
        assert r["q"] == f"HTTP 404 from {base}/nope"
    # Two pods, three scrapes each: one connection per pod, kept open between scrapes.
    assert engine_page.connections == 2


async def _serve_once(answer: bytes, hold: bool = False) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if hold:
                await asyncio.sleep(5)
            writer.write(answer)
            await writer.drain()
            if b"Content-Length" not in answer and b"chunked" not in answer:
                writer.close()
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"


GAUGES = b"vllm:num_requests_waiting 2\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n"


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(GAUGES) + GAUGES,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % 20
        + GAUGES[:20]
        + b"\r\n%x;x=1\r\n" % (len(GAUGES) - 20)
        + GAUGES[20:]
        + b"\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n" + GAUGES,  # delimited by the server closing the connection
    ],
    ids=["content-length", "chunked", "close"],
)
def test_the_scraper_reads_each_framing_of_a_page_twice(answer: bytes) -> None:
    async def run() -> list[Any]:
        server, url = await _serve_once(answer)
        scraper = Scraper(timeout=2.0)
        try:
            return [await scraper.scrape({"p": url}) for _ in range(2)]
        finally:
            await scraper.close()
            server.close()

    for result in asyncio.run(run()):
        assert result["p"].load.waiting == 2 and result["p"].load.kv_cache == 0.5


def test_a_pod_that_does_not_answer_in_time_is_reported_not_awaited() -> None:
    async def run() -> dict[str, Any]:
        server, url = await _serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", hold=True)
        scraper = Scraper(timeout=0.3)
        try:
            return await scraper.scrape({"p": url})
        finally:
            await scraper.close()
            server.close()

    result = asyncio.run(run())
    assert result["p"].startswith("TimeoutError: no answer from http://127.0.0.1:"), result
