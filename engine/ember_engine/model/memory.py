"""KV-cache sizing on a GPU: what the profiling run leaves for the cache, as plain arithmetic over a memory
report (so it can be checked without a device), and the report itself, read from the engine's own GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class MemoryReport:
    total: int  # the device's memory
    free: int  # free on the device, as the driver reports it (other processes' use included)
    reserved: int  # held by this process's caching allocator
    peak: int  # the most this process had allocated during the profiling run


def read_memory(device: torch.device) -> MemoryReport:
    """The report for `device` (never the current device, unless it is that one)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemoryReport(
        total, free, torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device)
    )


def kv_cache_blocks(report: MemoryReport, utilization: float, reserved_bytes: int, block_bytes: int) -> int:
    """Blocks that fit in `utilization` of the device after the profiled peak (the forward and the
    sampler at their largest), other processes' use and `reserved_bytes` (e.g. a draft model's weights)."""
    used_elsewhere = max(report.total - report.free - report.reserved, 0)
    budget = report.total * utilization - report.peak - used_elsewhere - reserved_bytes
    return int(budget // block_bytes)
