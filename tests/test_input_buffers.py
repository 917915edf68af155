"""The step's persistent input buffers lay a batch out exactly as a plain per-chunk construction would,
at fixed 16-byte-aligned offsets, and grow when a batch outgrows them."""

from __future__ import annotations

import random

import torch

from ember_engine.model.input_buffers import InputBuffers
from ember_engine.model.model_runner import Chunk

BS = 4


def _chunks(rng: random.Random, n: int) -> list[Chunk]:
    chunks = []
    for _ in range(n):
        start, count = rng.randrange(0, 30), rng.randrange(1, 9)
        blocks = rng.sample(range(100), -(-(start + count) // BS))
        chunks.append(
            Chunk(blocks, start, [rng.randrange(1000) for _ in range(count)], rng.randrange(0, count + 1))
        )
    return chunks


def test_the_layout_matches_a_plain_construction_step_after_step() -> None:
    rng = random.Random(3)
    buffers = InputBuffers(max_tokens=16, max_seqs=3, max_blocks=4, block_size=BS, device=torch.device("cpu"))
    for step in range(30):
        chunks = _chunks(rng, rng.randrange(1, 7))  # now and then more than the buffers were made for
        got = buffers.prepare(chunks)
        ids, pos, slots, rows, qloc, lens = [], [], [], [], [0], []
        for c in chunks:
            n = len(c.token_ids)
            ids += c.token_ids
            pos += range(c.start, c.start + n)
            slots += [c.block_ids[p // BS] * BS + p % BS for p in range(c.start, c.start + n)]
            qloc.append(qloc[-1] + n)
            rows += range(qloc[-1] - c.num_logits, qloc[-1])
            lens.append(c.start + n)
        assert got.input_ids.tolist() == ids, step
        assert got.positions.tolist() == pos
        assert got.slot_mapping.tolist() == slots
        assert got.query_start_loc.tolist() == qloc and got.seq_lens.tolist() == lens
        assert (rows if got.logit_rows is None else got.logit_rows.tolist()) == rows
        assert got.logit_rows is not None or rows == list(range(len(ids)))
        for i, c in enumerate(chunks):
            table = got.block_tables[i].tolist()
            assert table[: len(c.block_ids)] == c.block_ids and not any(table[len(c.block_ids) :])
        assert got.max_query_len == max(len(c.token_ids) for c in chunks) and got.max_seq_len == max(lens)
        for t in (got.input_ids, got.slot_mapping, got.query_start_loc, got.seq_lens, got.block_tables):
            assert t.data_ptr() % 16 == 0
