"""A quantized checkpoint on a tensor-parallel rank. Each projection's canonical tensors
(`checkpoint.decode`: values [out, in], scales [out] or [out, in / group], zero points [out, in / group])
are cut to the rank's shard as `Shard.checkpoint_range` cuts a full-precision tensor: output rows for the
projections split by output (q/k/v, gate/up), input columns for those split by input (o, down), whose
groups must lie within a rank's columns; a row's scale is the whole row's, so each rank holds the unsplit
model's very values and scales, and a per-column tensor (AWQ's smoothing factors) is cut as the columns
are (`columns`). 4-bit codes two a byte along the input (NVFP4's E2M1 values, bitsandbytes'
NF4 and FP4 codes, GGUF i-quants' codes: uint8 [out, in / 2]) are cut by bytes, at the groups' edges. A quantized LM head is
held dequantized, split by vocabulary rows as a full-precision one. What cannot be cut so (other weights
packed along the input, run-time rotations, GPTQ's activation order) is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ember_engine.model.parallel import INPUT_SPLIT
from ember_engine.model.quant.schemes import UnsupportedQuantizationError

Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
HEAD = "lm_head"


class RankSplit:
    """A tensor-parallel rank's cut of a quantized checkpoint's projections (`cut`), and its quantized LM
    head held dequantized (`head_rows`); with one rank, nothing to cut."""

    def __init__(self, model: Any, spec: Any, layers: dict[str, Any], specs: dict[str, Any]) -> None:
        shard = getattr(model, "shard", None)
        self.shard, self.size = shard, (shard.size if shard is not None else 1)
        self.head_dim = int(model.config.head_dim) if shard is not None else 0
        self.head: Any = None
        self.placed: set[str] = set()  # full-precision parameters filled from quantized tensors
        if self.size == 1:
            return
        if spec.rotations:
            raise UnsupportedQuantizationError(
                "the checkpoint's transform_config rotates layers as the model runs; tensor_parallel_size > 1 "
                "is not supported with it"
            )
        held = spec.layer_spec(HEAD)
        if held is not None and HEAD not in layers:  # left a full-precision (vocabulary-split) head
            self.head = getattr(model, HEAD)
            specs[HEAD] = held

    def cut(self, projection: str, in_features: int, decoded: Decoded) -> Decoded:
        """This rank's part of checkpoint projection `projection`'s decoded tensors; `in_features` the
        rank's layer's input size."""
        if self.shard is None or self.size == 1:
            return decoded
        weight, scale, zero = decoded
        span = self.shard.checkpoint_range(f"{projection}.weight", self.head_dim)
        if span is None:
            return decoded
        dim, start, length = span
        columns = in_features * self.size if dim == 1 else in_features
        per_byte = (
            2 if weight.dtype == torch.uint8 and weight.dim() == 2 and weight.shape[1] * 2 == columns else 1
        )
        if weight.dim() != 2 or weight.shape[1] * per_byte != columns:
            raise UnsupportedQuantizationError(
                f"{projection}: its weight is held packed ({list(weight.shape)} for {columns} input columns); "
                "tensor_parallel_size > 1 is not supported with it"
            )
        if dim == 0:
            rows = weight.shape[0]
            return (
                weight[start : start + length],
                _rows(scale, rows, start, length),
                _rows(zero, rows, start, length),
            )
        groups = scale.shape[1] if scale.dim() >= 2 else 1  # w4a8-fp8's [out, groups, 16] tables too
        if groups > 1:
            size = columns // groups
            if start % size or length % size:
                raise UnsupportedQuantizationError(
                    f"{projection}: groups of {size} input columns do not fall within a rank's {length} "
                    f"columns with tensor_parallel_size {self.size}"
                )
            scale = scale[:, start // size : (start + length) // size]
            zero = None if zero is None else zero[:, start // size : (start + length) // size]
        assert start % per_byte == 0 and length % per_byte == 0  # whole groups (16, 32 or 64 columns)
        cut = weight[:, start // per_byte : (start + length) // per_byte]
        return cut.contiguous(), scale, zero

    def columns(self, projection: str, vector: torch.Tensor) -> torch.Tensor:
        """A per-input-column tensor [in] of checkpoint projection `projection` (AWQ's smoothing factors):
        this rank's columns of a projection split by input, the whole of one split by output."""
        if self.shard is None or self.size == 1:
            return vector
        span = self.shard.checkpoint_range(f"{projection}.weight", self.head_dim)
        if span is None or span[0] == 0:
            return vector
        _, start, length = span
        return vector.reshape(-1)[start : start + length]

    def head_rows(
        self, spec: Any, decoded: Decoded, empty: Callable[..., Any], place: Callable[[Any], None]
    ) -> None:
        """Fill the rank's LM head rows from the whole head's decoded tensors (`empty(spec, in, out, bias,
        like)` makes the quantized layer that dequantizes them as one rank would; `place(layer)` gives it
        the scales beside the decoded ones)."""
        weight, scale, zero = decoded
        assert self.shard is not None
        like = self.head.weight
        full = empty(spec, weight.shape[1], weight.shape[0], False, like)
        full.set_rows(0, weight.to(like.device), scale)
        if zero is not None:
            full.set_zero_rows(0, zero)
        place(full)
        start, rows = self.shard.vocab_start, self.shard.vocab_rows
        like.data[:rows].copy_(full.dequantized(like.dtype)[start : start + rows])
        self.placed.add(f"{HEAD}.weight")


def check_groups(scheme: str, group: int, name: str, in_features: int, size: int) -> None:
    """A rank's columns of a projection split by them must be whole groups."""
    if size > 1 and group and name in INPUT_SPLIT and in_features % group:
        raise UnsupportedQuantizationError(
            f"{scheme}: groups of {group} input columns do not fall within a rank's {in_features} columns of "
            f"{name} with tensor_parallel_size {size}"
        )


def _rows(t: torch.Tensor | None, rows: int, start: int, length: int) -> Any:
    """A per-row tensor's rows start..; a scale per tensor as it is."""
    if t is None or t.dim() == 0 or t.shape[0] != rows:
        return t
    return t[start : start + length]
