"""Hadamard rotations a compressed-tensors checkpoint needs applied as the model runs (`transform_config` at
locations "input" and "output": llm-compressor's QuIP, whose V rotates each projection's input and U its
output, and SpinQuant's R4 on the down projection's input). The inverse rotations are folded into the
weights; the ones at run time are not, so skipping them computes another model.

A group's matrix is Hadamard's (`hadamard`, Sylvester's, or `random-hadamard`), ±1 entries, one per size
the group meets (a checkpoint stores each once, under the first projection that uses it, as
`{projection}.{group}_{location}.weight`); a rotation takes x to x H / sqrt(n) (H transposed for an
inverse one) over each block of n columns (n the group's head_dim, else the whole width), computed in the
group's `precision`, as compressed-tensors' HadamardTransform computes it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import OnlineRotation


class Rotation(nn.Module):
    """One rotation at run time: x -> x H / sqrt(n) over each block of n columns, in the group's precision,
    back in x's dtype."""

    def __init__(self, matrix: torch.Tensor, rotation: OnlineRotation) -> None:
        super().__init__()
        dtype = getattr(torch, rotation.precision.removeprefix("torch."))
        m = matrix.to(torch.float64)
        m = (m.T if rotation.inverse else m) / math.sqrt(m.shape[0])
        self.register_buffer("matrix", m.to(dtype))
        self.matrix: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.matrix.shape[0]
        y = x.to(self.matrix.dtype).unflatten(-1, (-1, n)) @ self.matrix
        return y.flatten(-2).to(x.dtype)


class OutputRotations(nn.Module):
    """A merged projection's output rotated part by part (each part's rows, each its own matrix)."""

    def __init__(self, parts: list[tuple[int, Rotation]]) -> None:
        super().__init__()
        self.sizes = [size for size, _ in parts]
        self.parts = nn.ModuleList(r for _, r in parts)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](y)
        return torch.cat([r(p) for r, p in zip(self.parts, y.split(self.sizes, dim=-1), strict=True)], dim=-1)


class RotationMatrices:
    """The matrices a checkpoint holds for its run-time rotations, by (group, location, size)."""

    def __init__(self, rotations: tuple[OnlineRotation, ...]) -> None:
        self.wanted = {(r.group, r.location) for r in rotations}
        self.found: dict[tuple[str, str, int], torch.Tensor] = {}
        self.made: dict[tuple[OnlineRotation, int], Rotation] = {}  # one module, its matrix, for every layer

    def take(self, name: str, tensor_slice: object) -> bool:
        stem, _, kind = name.rpartition(".")
        group, _, location = stem.rpartition(".")[2].rpartition("_")
        if (group, location) not in self.wanted or kind != "weight":
            return False
        matrix = tensor_slice[:]  # type: ignore[index]
        size = matrix.shape[0]
        if matrix.dim() != 2 or matrix.shape[1] != size:
            raise UnsupportedQuantizationError(
                f"{name}: a rotation's matrix must be square, found {list(matrix.shape)}"
            )
        held = self.found.setdefault((group, location, size), matrix)
        if not torch.equal(held, matrix):
            raise UnsupportedQuantizationError(
                f"{name}: transform group {group!r} holds two different {size}x{size} matrices at its {location}"
            )
        return True

    def rotation(self, rotation: OnlineRotation, width: int, what: str) -> Rotation:
        """The module for `rotation` over a width of `width` (layer `what`), shared by every layer it
        rotates at that size."""
        size = rotation.head_dim or width
        if width % size:
            raise UnsupportedQuantizationError(
                f"{what}: transform group {rotation.group!r} rotates blocks of {size}, which do not divide its "
                f"{rotation.location} of {width}"
            )
        matrix = self.found.get((rotation.group, rotation.location, size))
        if matrix is None:
            raise UnsupportedQuantizationError(
                f"{what}: the checkpoint holds no {size}x{size} matrix for transform group {rotation.group!r} "
                f"at {rotation.location} ({rotation.group}_{rotation.location}.weight)"
            )
        if (rotation, size) not in self.made:
            self.made[(rotation, size)] = Rotation(matrix, rotation)
        return self.made[(rotation, size)]
