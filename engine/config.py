"""Engine options (the `ember serve` flags and `LLM(**options)` keywords)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # explicit cache size in blocks...
    kv_cache_memory: int | None = None  # ...or in bytes; else profiled (GPU) or a default (CPU)
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enforce_eager: bool = False  # GPU: skip CUDA graphs
    seed: int = 0

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            bad("kv_cache_memory", f"must be >= 1 byte, got {self.kv_cache_memory}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad("scheduling_policy", f"unknown {self.scheduling_policy!r}; choose fcfs or priority")
