"""KV-cache sizing: one block's bytes, the blocks a given memory holds, and on a GPU what the profiling run
leaves for the cache, as plain arithmetic over a memory report (so it can be checked without a device), and
the report itself, read from the engine's own GPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember_engine.model.model_config import ModelConfig

log = logging.getLogger(__name__)


def kv_block_bytes(
    model_config: ModelConfig, dtype: torch.dtype, block_size: int, num_kv_heads: int | None = None
) -> int:
    """One block's K and V; `num_kv_heads` is a tensor-parallel rank's share (default: all of them)."""
    c = model_config
    heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * c.num_layers * heads * c.head_dim * dtype.itemsize * block_size


def blocks_in(kv_cache_memory: int, block_bytes: int) -> int:
    """The blocks `kv_cache_memory` bytes hold; less than one block is refused, not rounded up."""
    if kv_cache_memory < block_bytes:
        raise ValueError(
            f"kv_cache_memory: {kv_cache_memory} bytes is less than one KV block ({block_bytes} bytes)"
        )
    return kv_cache_memory // block_bytes


def fitted_max_model_len(max_model_len: int, num_blocks: int, block_size: int, explicit: bool) -> int:
    """The longest sequence the engine takes: the model's own limit is lowered to what the cache holds;
    one the user gave (`explicit`) is refused when the cache cannot hold it."""
    capacity = num_blocks * block_size
    if capacity >= max_model_len:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens do not fit in the KV cache ({num_blocks} blocks of "
            f"{block_size} tokens); give the cache more memory or lower max_model_len"
        )
    log.warning(
        "KV cache holds %d tokens; max_model_len lowered from the model's %d", capacity, max_model_len
    )
    return capacity


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
