"""KV-cache sizing arithmetic over a memory report (the numbers a GPU's profiling run would give)."""

from __future__ import annotations

from ember_engine.model.memory import MemoryReport, kv_cache_blocks

GiB, MiB = 1 << 30, 1 << 20


def test_the_cache_gets_what_the_peak_other_processes_and_reservations_leave() -> None:
    # 80 GiB device; 10 GiB in use, 4 of it ours (so 6 GiB belong to someone else); the profiled step
    # peaked at 3 GiB; a draft model's weights reserve 1 GiB.
    report = MemoryReport(total=80 * GiB, free=70 * GiB, reserved=4 * GiB, peak=3 * GiB)
    blocks = kv_cache_blocks(report, utilization=0.9, reserved_bytes=1 * GiB, block_bytes=2 * MiB)
    assert blocks == int((72 - 3 - 6 - 1) * GiB // (2 * MiB)) == 31744


def test_our_own_reservation_is_not_counted_twice() -> None:
    # The allocator's cache is ours: free + reserved can exceed what the driver would call used.
    report = MemoryReport(total=16 * GiB, free=15 * GiB, reserved=2 * GiB, peak=1 * GiB)
    assert kv_cache_blocks(report, 1.0, 0, 1 * GiB) == 15
    assert kv_cache_blocks(report, 0.05, 0, 1 * GiB) < 1  # nothing left: the runner refuses to start
