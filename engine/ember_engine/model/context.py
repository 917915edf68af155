"""The batch layout of the forward pass in flight, read by every attention layer.

One per thread instead of metadata threaded through every module's forward (nano-vllm's choice): the
model code stays the plain math of the architecture, and engines stepping in different threads of one
process do not see each other's batches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class ForwardContext:
    slot_mapping: torch.Tensor  # [N] int64: cache slot of each new token; -1 skips the row
    query_start_loc: torch.Tensor  # [B+1] int32: sequence i owns rows [q[i], q[i+1])
    seq_lens: torch.Tensor  # [B] int32: keys per sequence, this step's tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    gather_plan: Any = None  # the CPU attention path's per-step plan, built by the first layer
    lora: Any = None  # lora.StepAdapters: the rows of each LoRA adapter in the step; None: none


_local = threading.local()


def set_context(context: ForwardContext | None) -> None:
    _local.context = context


def get_context() -> ForwardContext:
    context: ForwardContext | None = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("no forward context: the model runs only inside ModelRunner")
    return context
