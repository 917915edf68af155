"""Engine options (the `ember serve` flags and `LLM(**options)` keywords)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# Weight quantization schemes (README "Quantization").
QUANT_SCHEMES = ("fp8", "w8a16", "w4a16", "w8a8", "bitsandbytes")
# A quantized checkpoint's own method, also accepted as `quantization` for it (vLLM's names; the checkpoint
# runs in its own scheme). fp8 and bitsandbytes are schemes too.
CHECKPOINT_METHODS = (
    "compressed-tensors",
    "gptq",
    "gptq_marlin",
    "awq",
    "awq_marlin",
    "modelopt",
    "modelopt_fp4",
    "quark",
    "gguf",
    "fbgemm_fp8",
)
# KV cache element types (README "FP8 KV cache"): auto is the model's dtype; fp8_e4m3 is fp8 (vLLM's
# name for the same cache); fp8_e5m2 is E5M2, with the same per-layer scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def is_gguf(model: str | os.PathLike[str]) -> bool:
    """Whether `model` names a GGUF file (llama.cpp's format; `model/gguf`) rather than a checkpoint
    directory. Here, without the GGUF reader, so that what only asks (the router) does not load torch."""
    return os.fspath(model).endswith(".gguf")


def adapter_name_problem(name: object) -> str | None:
    """Why `name` cannot name a LoRA adapter: it must be printable text (no control characters, which the
    prefix cache's keys keep for themselves) without surrounding spaces."""
    if not isinstance(name, str) or not name or name != name.strip() or not name.isprintable():
        return f"an adapter's name must be printable text without surrounding spaces, got {name!r}"
    return None


@dataclass(slots=True)
class EngineConfig:
    model: str  # a Hugging Face checkpoint directory, or a .gguf file
    # The directory of the tokenizer files (tokenizer.json) when they are not the model's (a GGUF file's
    # base model)
    tokenizer: str | None = None
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
    seed: int = 0
    # Speculative decoding: "draft" (a smaller model with the same tokenizer) or "ngram" (prompt lookup).
    speculative_method: str | None = None  # default: "draft" when draft_model is given, else off
    draft_model: str | None = None
    # Unset (None), each takes its default where a proposer uses it (speculative_tokens, ngram_range,
    # adaptive); a value given for an option no proposer uses is refused.
    num_speculative_tokens: int | None = None  # K, the most tokens proposed per request per step (4)
    ngram_min: int | None = None  # n-gram lookup: the shortest and longest suffix matched (2, 4)
    ngram_max: int | None = None
    speculative_adaptive: bool | None = None  # turn speculation off (or K down) where it does not pay (on)
    # Tensor parallelism: the model split across this many ranks (one per GPU), over `nnodes` nodes.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0  # 0 runs the scheduler and the API; the others only their ranks
    # Rank 0's rendezvous when nnodes > 1: node 0 listens at this address (0.0.0.0: every interface),
    # the other nodes connect to it.
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Weights quantized at load (a checkpoint that is already quantized is run in its own scheme).
    quantization: str | None = None
    # The KV cache's element type: "auto" (the model's dtype), "fp8" (E4M3 with per-layer scales) or
    # "fp8_e5m2" (E5M2, the same scales).
    kv_cache_dtype: str = "auto"
    # LoRA adapters (PEFT directories) by the name requests use for them; every one loaded at start.
    lora_modules: dict[str, str] | None = None
    # The most adapters one step may run (requests on another wait for room; None: any number), and the
    # highest rank an adapter may have (None: any), as vLLM's --max-loras and --max-lora-rank.
    max_loras: int | None = None
    max_lora_rank: int | None = None

    @property
    def speculation(self) -> str | None:
        """The proposer in use, or None when speculative decoding is off."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft" if self.draft_model is not None else None

    @property
    def speculative_tokens(self) -> int:
        return 4 if self.num_speculative_tokens is None else self.num_speculative_tokens

    @property
    def ngram_range(self) -> tuple[int, int]:
        return (
            2 if self.ngram_min is None else self.ngram_min,
            4 if self.ngram_max is None else self.ngram_max,
        )

    @property
    def adaptive(self) -> bool:
        return self.speculative_adaptive is not False

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            bad("device", f"unknown {self.device!r}; choose auto, cpu or cuda (cuda:N for one of several)")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                bad("device", f"{self.device} requested, but torch sees no CUDA device")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            bad("num_kv_blocks and kv_cache_memory", "give one or the other, not both")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            bad("kv_cache_memory", f"must be >= 1 byte, got {self.kv_cache_memory}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad("scheduling_policy", f"unknown {self.scheduling_policy!r}; choose fcfs or priority")
        if self.speculative_method not in (None, "draft", "ngram"):
            bad("speculative_method", f"unknown {self.speculative_method!r}; choose draft or ngram")
        if self.speculation == "draft" and self.draft_model is None:
            bad("draft_model", "is required when speculative_method is draft")
        if self.speculation == "ngram" and self.draft_model is not None:
            bad("draft_model", "is only used with speculative_method draft, not ngram")
        given = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "ngram_min": self.ngram_min,
            "ngram_max": self.ngram_max,
            "speculative_adaptive": self.speculative_adaptive,
        }
        if self.speculation is None and (unused := [k for k, v in given.items() if v is not None]):
            bad(
                ", ".join(unused),
                "only used with speculative decoding (draft_model or speculative_method ngram), "
                "which is off: nothing would use it",
            )
        if self.speculation == "draft" and (
            unused := [k for k in ("ngram_min", "ngram_max") if given[k] is not None]
        ):
            bad(", ".join(unused), "is only used with speculative_method ngram, not draft")
        if not 1 <= self.speculative_tokens <= 16:
            bad("num_speculative_tokens", f"must be in [1, 16], got {self.speculative_tokens}")
        if self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            bad(
                "nnodes",
                f"must be >= 1 and divide tensor_parallel_size {self.tensor_parallel_size}, got {self.nnodes}",
            )
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in [0, nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            bad("master_port", f"must be a TCP port when nnodes > 1, got {self.master_port}")
        if self.quantization is not None and self.quantization not in QUANT_SCHEMES + CHECKPOINT_METHODS:
            bad(
                "quantization",
                f"unsupported scheme {self.quantization!r}; supported: {', '.join(QUANT_SCHEMES)} (at load), "
                f"or a quantized checkpoint's own method: {', '.join(CHECKPOINT_METHODS)}",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(
                "kv_cache_dtype",
                f"unsupported {self.kv_cache_dtype!r}; supported: {', '.join(KV_CACHE_DTYPES)}",
            )
        for field_name in ("max_loras", "max_lora_rank"):
            if (value := getattr(self, field_name)) is not None and value < 1:
                bad(field_name, f"must be >= 1, got {value}")
        for name in self.lora_modules or {}:
            if (problem := adapter_name_problem(name)) is not None:
                bad("lora_modules", problem)
        ngram_min, ngram_max = self.ngram_range
        if not 1 <= ngram_min <= ngram_max:
            bad("ngram_min", f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
