"""The policy file: parsing, validation messages, and the watcher that reloads it without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from ember_engine.server.policy import Policy, PolicyError, PolicyWatcher, load_policy, parse_policy

FULL = """
loadShedding:
  maxQueueDepth: 64
  maxQueueWaitSeconds: 2.0
  retryAfterSeconds: 2
  maxConcurrentPerClient: 4
  priorityClasses:
    - {name: critical, priority: 0}
    - {name: standard, priority: 1}
    - {name: batch, priority: 2}
  defaultPriorityClass: standard
fallback:
  url: http://chat-small.default.svc:8000/
  model: chat-small
  when: [Overloaded, Unavailable]
  timeoutSeconds: 30
requestTimeoutSeconds: 60
"""


def test_empty_file_gives_defaults() -> None:
    for text in ("", "# nothing set\n", "fallback:\n"):
        policy = parse_policy(text)
        assert policy == Policy()
    shedding = policy.load_shedding
    assert shedding.max_queue_depth == 0  # every limit off: a policy that says nothing sheds nothing
    assert shedding.max_queue_wait_seconds == 0
    assert shedding.max_concurrent_per_client == 0
    assert [c.name for c in shedding.priority_classes] == ["critical", "standard", "batch"]
    assert shedding.default_priority_class == "standard"
    assert policy.fallback.url is None
    assert policy.request_timeout_seconds == 0


def test_full_example_parses() -> None:
    policy = parse_policy(FULL)
    shedding = policy.load_shedding
    assert shedding.max_queue_depth == 64
    assert shedding.max_queue_wait_seconds == 2.0
    assert shedding.retry_after_seconds == 2
    assert shedding.max_concurrent_per_client == 4
    assert [(c.name, c.priority) for c in shedding.priority_classes] == [
        ("critical", 0),
        ("standard", 1),
        ("batch", 2),
    ]
    assert policy.fallback.url == "http://chat-small.default.svc:8000"  # trailing slash dropped
    assert policy.fallback.model == "chat-small"
    assert policy.fallback.when == ["Overloaded", "Unavailable"]
    assert policy.fallback.timeout_seconds == 30.0
    assert policy.request_timeout_seconds == 60.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "loadShedding: {maxQueueDepth: -1}",
            "loadShedding.maxQueueDepth: Input should be greater than or equal",
        ),
        ("loadShedding: {maxQueueDepht: 8}", "loadShedding.maxQueueDepht: unknown field"),
        ("fallbak: {url: http://x}", "fallbak: unknown field"),
        ("loadShedding: {max_queue_depth: 8}", "loadShedding.max_queue_depth: unknown field"),
        (
            "loadShedding: {maxQueueDepth: '64'}",
            "loadShedding.maxQueueDepth: Input should be a valid integer",
        ),
        ("fallback: {when: [Overloaded, Sometimes]}", "fallback.when[1]: Input should be 'Overloaded' or"),
        (
            "loadShedding: {defaultPriorityClass: gold}",
            "loadShedding.defaultPriorityClass: 'gold' is not one",
        ),
        (
            "loadShedding: {priorityClasses: [{name: a, priority: 0}, {name: a, priority: 1}]}",
            "loadShedding.priorityClasses: class names must be unique",
        ),
        (
            "loadShedding: {priorityClasses: [{name: a}]}",
            "loadShedding.priorityClasses[0].priority: Field required",
        ),
        ("fallback: {url: 'ftp://x'}", "fallback.url: must be an http:// or https:// URL"),
        ("requestTimeoutSeconds: .inf", "requestTimeoutSeconds: Input should be a finite number"),
        ("loadShedding: {maxQueueDepth: [1", "not valid YAML at line 1"),
        ("- loadShedding\n- fallback\n", "must be a YAML mapping of fields, got a list"),
    ],
)
def test_invalid_policy_names_the_field(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    assert expected in str(info.value)


def test_load_policy_reads_a_file_and_reports_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(FULL)
    assert load_policy(path) == parse_policy(FULL)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "absent.yaml")


def test_watcher_without_a_file_uses_defaults() -> None:
    watcher = PolicyWatcher(None)
    assert watcher.policy == Policy()
    assert watcher.check() is False


def test_watcher_rejects_an_invalid_file_at_startup(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("loadShedding: {maxQueueDepth: -1}")
    with pytest.raises(PolicyError, match=r"loadShedding\.maxQueueDepth"):
        PolicyWatcher(path)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        PolicyWatcher(tmp_path / "absent.yaml")


def test_watcher_picks_up_a_rewrite_and_keeps_the_last_good_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("loadShedding: {maxQueueDepth: 8}")
    seen: list[Policy] = []
    watcher = PolicyWatcher(path, on_change=seen.append)
    assert watcher.policy.load_shedding.max_queue_depth == 8
    assert watcher.check() is False  # unchanged

    stat = path.stat()
    path.write_text("loadShedding: {maxQueueDepth: 9}")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the content differs
    assert watcher.check() is True
    assert watcher.policy.load_shedding.max_queue_depth == 9
    assert seen == [watcher.policy]

    with caplog.at_level(logging.WARNING, logger="ember.policy"):
        path.write_text("loadShedding: {maxQueueDepth: -5}")
        assert watcher.check() is False
        assert watcher.check() is False  # the same bad file is reported once
    assert watcher.policy.load_shedding.max_queue_depth == 9
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "keeping the last good policy" in warnings[0]
    assert "loadShedding.maxQueueDepth" in warnings[0]

    path.write_text("# a comment only changes nothing\nloadShedding: {maxQueueDepth: 9}")
    assert watcher.check() is False  # the content changed, the policy did not
    path.unlink()
    assert watcher.check() is False  # a vanished file keeps the policy too
    path.write_text("loadShedding: {maxQueueDepth: 10}")
    assert watcher.check() is True
    assert [p.load_shedding.max_queue_depth for p in seen] == [9, 10]


def _configmap_version(mount: Path, stamp: str, text: str) -> None:
    """Point `..data` at a new timestamped directory the way the kubelet does: atomically, via a rename."""
    version = mount / f"..{stamp}"
    version.mkdir()
    (version / "policy.yaml").write_text(text)
    tmp = mount / "..data_tmp"
    tmp.symlink_to(version.name)
    os.replace(tmp, mount / "..data")


def test_watcher_follows_a_configmap_symlink_swap(tmp_path: Path) -> None:
    mount = tmp_path / "policy"
    mount.mkdir()
    _configmap_version(mount, "2026_01_01_00_00_00.1", "loadShedding: {maxQueueDepth: 8}")
    (mount / "policy.yaml").symlink_to("..data/policy.yaml")
    watcher = PolicyWatcher(mount / "policy.yaml")
    assert watcher.policy.load_shedding.max_queue_depth == 8

    _configmap_version(mount, "2026_01_01_00_01_00.2", "loadShedding: {maxQueueDepth: 16}")
    assert watcher.check() is True
    assert watcher.policy.load_shedding.max_queue_depth == 16
    assert watcher.check() is False

    _configmap_version(mount, "2026_01_01_00_02_00.3", "loadShedding: {maxQueueDepth: 16}  # same policy")
    assert watcher.check() is False
    _configmap_version(mount, "2026_01_01_00_03_00.4", "loadShedding: {maxQueueDepth: oops}")
    assert watcher.check() is False
    assert watcher.policy.load_shedding.max_queue_depth == 16


def test_watcher_run_polls_and_survives_a_failing_callback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("requestTimeoutSeconds: 1")
    calls: list[float] = []

    def on_change(policy: Policy) -> None:
        calls.append(policy.request_timeout_seconds)
        if len(calls) == 1:
            raise RuntimeError("callback bug")

    watcher = PolicyWatcher(path, on_change=on_change)

    async def scenario() -> None:
        task = asyncio.create_task(watcher.run(interval=0.01))
        for timeout in (2, 3):
            path.write_text(f"requestTimeoutSeconds: {timeout}")
            for _ in range(200):
                await asyncio.sleep(0.01)
                if watcher.policy.request_timeout_seconds == timeout:
                    break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.ERROR, logger="ember.policy"):
        asyncio.run(scenario())
    assert calls == [2.0, 3.0]
    assert any("callback failed" in r.getMessage() for r in caplog.records)


def test_priority_of() -> None:
    watcher = PolicyWatcher(None)
    assert watcher.priority_of(None) == ("standard", 1)
    assert watcher.priority_of("critical") == ("critical", 0)
    assert watcher.priority_of("batch") == ("batch", 2)
    with pytest.raises(
        PolicyError, match="unknown priority class 'gold'; valid classes: critical, standard, batch"
    ):
        watcher.priority_of("gold")
    custom = parse_policy(
        "loadShedding: {priorityClasses: [{name: hi, priority: 5}, {name: lo, priority: 9}], "
        "defaultPriorityClass: lo}"
    )
    assert custom.priority_of(None) == ("lo", 9)
