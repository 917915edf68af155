"""Persistent forward inputs: one staging buffer on the host, its twin on the device, one upload a step.

The step's input ids, positions, slot mapping and logit rows (int64) and query starts, sequence lengths
and block tables (int32) live at fixed offsets in one byte buffer. The host side (pinned when the device
is a GPU) is filled with vectorised numpy, then copied to the device with a single non-blocking copy; on a
CPU the two are one buffer. Block tables have a fixed width, the most blocks a sequence can hold, so the
attention kernels see the same strides every step. The step that follows overwrites the buffer, which is
safe because every step reads its sampled tokens (a synchronisation) before the next is laid out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import numpy as np
import torch

from ember_engine.model.context import ForwardContext


class ChunkLike(Protocol):
    block_ids: list[int]
    start: int
    token_ids: Sequence[int]
    num_logits: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    logit_rows: torch.Tensor | None  # [L] int64; None when every token is a logit row (pure decode)
    num_logits: int
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int

    def context(self, lora: Any = None) -> ForwardContext:
        """The forward context of this step (`lora`: its rows per LoRA adapter, if any)."""
        return ForwardContext(
            self.slot_mapping,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.max_query_len,
            self.max_seq_len,
            lora=lora,
        )


class InputBuffers:
    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.device, self.block_size, self.width = device, block_size, max(1, max_blocks)
        self._allocate(max(1, max_tokens), max(1, max_seqs))
        self.uploads = 0  # host-to-device copies made (one per step on a GPU)

    def _allocate(self, max_tokens: int, max_seqs: int) -> None:
        # Sections start 16-byte aligned, so a kernel sees the same pointer alignment whatever the layout.
        max_tokens, max_seqs = -(-max_tokens // 2) * 2, -(-(max_seqs + 1) // 4) * 4
        self.max_tokens, self.max_seqs = max_tokens, max_seqs - 1
        n64, n32 = 4 * max_tokens, 2 * max_seqs + max_seqs * self.width
        nbytes = 8 * n64 + 4 * n32
        self._tables_at = 8 * n64 + 4 * 2 * max_seqs  # byte offset of the block tables, the last section
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if cuda else self.host
        h64, h32 = self.host.numpy()[: 8 * n64].view(np.int64), self.host.numpy()[8 * n64 :].view(np.int32)
        d64, d32 = self.dev[: 8 * n64].view(torch.int64), self.dev[8 * n64 :].view(torch.int32)
        t, s = max_tokens, max_seqs
        self.h_ids, self.h_pos, self.h_slots, self.h_rows = (h64[i * t : (i + 1) * t] for i in range(4))
        self.d_ids, self.d_pos, self.d_slots, self.d_rows = (d64[i * t : (i + 1) * t] for i in range(4))
        self.h_qloc, self.h_lens, self.h_tables = h32[:s], h32[s : 2 * s], h32[2 * s :]
        self.d_qloc, self.d_lens, self.d_tables = d32[:s], d32[s : 2 * s], d32[2 * s :]

    def prepare(self, chunks: Sequence[ChunkLike]) -> StepInputs:
        """Lay the chunks out in the staging buffer and upload it; returns device views of this step."""
        b = len(chunks)
        lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=b)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=b)
        wanted = np.fromiter((c.num_logits for c in chunks), dtype=np.int64, count=b)
        nblocks = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int64, count=b)
        t, n_logits = int(lens.sum()), int(wanted.sum())
        if t > self.max_tokens or b > self.max_seqs or int(nblocks.max()) > self.width:
            self.width = max(self.width, int(nblocks.max()))
            self._allocate(max(t, self.max_tokens), max(b, self.max_seqs))
        w, bs = self.width, self.block_size
        ends = np.cumsum(lens)
        qloc = self.h_qloc[: b + 1]
        qloc[0] = 0
        qloc[1:] = ends
        self.h_ids[:t] = np.fromiter(
            chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=t
        )
        row = np.repeat(np.arange(b), lens)
        pos = self.h_pos[:t]
        pos[:] = np.arange(t) - np.repeat(ends - lens - starts, lens)
        tables = self.h_tables[: b * w]
        tables.fill(0)
        total_blocks = int(nblocks.sum())
        flat_blocks = np.fromiter(
            chain.from_iterable(c.block_ids for c in chunks), dtype=np.int32, count=total_blocks
        )
        block_start = np.cumsum(nblocks) - nblocks
        tables[np.arange(total_blocks) + np.repeat(np.arange(b) * w - block_start, nblocks)] = flat_blocks
        self.h_slots[:t] = tables[row * w + pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = starts + lens
        self.h_lens[:b] = seq_lens
        pure_decode = n_logits == t
        if not pure_decode and n_logits:
            self.h_rows[:n_logits] = np.arange(n_logits) + np.repeat(
                ends - wanted - (np.cumsum(wanted) - wanted), wanted
            )
        if self.dev is not self.host:
            # Everything up to the last used block-table row: one copy, the unused rows left behind.
            end = self._tables_at + 4 * b * w
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
            self.uploads += 1
        return StepInputs(
            input_ids=self.d_ids[:t],
            positions=self.d_pos[:t],
            slot_mapping=self.d_slots[:t],
            logit_rows=None if pure_decode else self.d_rows[:n_logits],
            num_logits=n_logits,
            query_start_loc=self.d_qloc[: b + 1],
            seq_lens=self.d_lens[:b],
            block_tables=self.d_tables[: b * w].view(b, w),
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
