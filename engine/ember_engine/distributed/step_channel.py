"""Rank 0's one message per step: the chunks its runner is about to run, broadcast to the other ranks.

What crosses is exactly the runner's input (`Chunk`s: block table, start, tokens, logits wanted), so each
rank lays out the same batch with the same code and runs the same forward. The message is flat int32:

    [kind, num_chunks, (start, num_tokens, num_logits, num_blocks) per chunk, tokens..., block ids...]

It goes out in one broadcast of a fixed HEADER-sized buffer (a decode batch of dozens of sequences fits);
only a larger step sends its remainder in a second one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ember_engine.model.model_runner import Chunk

FORWARD, STOP = 1, 2
HEADER = 4096  # int32 slots: 16 KiB


def encode(chunks: Sequence[Chunk]) -> np.ndarray:
    head = [FORWARD, len(chunks)]
    for c in chunks:
        head += [c.start, len(c.token_ids), c.num_logits, len(c.block_ids), c.adapter]
    parts = [np.asarray(head, dtype=np.int32)]
    parts += [np.asarray(c.token_ids, dtype=np.int32) for c in chunks]
    parts += [np.asarray(c.block_ids, dtype=np.int32) for c in chunks]
    return np.concatenate(parts)


def decode(message: np.ndarray) -> list[Chunk] | None:
    """The chunks of a FORWARD message; None for STOP."""
    if message[0] == STOP:
        return None
    n = int(message[1])
    meta = message[2 : 2 + 5 * n].reshape(n, 5).tolist()
    at = 2 + 5 * n
    tokens = []
    for _, num_tokens, _, _, _ in meta:
        tokens.append(message[at : at + num_tokens].tolist())
        at += num_tokens
    chunks = []
    for (start, _, num_logits, num_blocks, adapter), token_ids in zip(meta, tokens, strict=True):
        chunks.append(Chunk(message[at : at + num_blocks].tolist(), start, token_ids, num_logits, adapter))
        at += num_blocks
    return chunks


class StepChannel:
    """The broadcast over the group's control (gloo, CPU) group; `seconds` totals rank 0's time in it."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.seconds = 0.0

    def send(self, chunks: Sequence[Chunk]) -> None:
        self._send(encode(chunks))

    def send_stop(self) -> None:
        self._send(np.asarray([STOP, 0], dtype=np.int32))

    def _send(self, message: np.ndarray) -> None:
        start = time.perf_counter()
        n = len(message)
        buf = torch.zeros(HEADER, dtype=torch.int32)
        buf[0] = n
        first = min(n, HEADER - 1)
        buf[1 : 1 + first] = torch.from_numpy(message[:first])
        dist.broadcast(buf, src=0, group=self.group)
        if n > first:
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(message[first:])), src=0, group=self.group)
        self.seconds += time.perf_counter() - start

    def receive(self) -> list[Chunk] | None:
        """Block until rank 0's next message: its chunks, or None when the engine stops."""
        buf = torch.zeros(HEADER, dtype=torch.int32)
        dist.broadcast(buf, src=0, group=self.group)
        n = int(buf[0])
        first = min(n, HEADER - 1)
        message = buf[1 : 1 + first].numpy()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.int32)
            dist.broadcast(rest, src=0, group=self.group)
            message = np.concatenate([message, rest.numpy()])
        return decode(message)
