"""4-bit codebook weights: bitsandbytes' NF4 and FP4 (`bnb.py` reads their checkpoints) and GGUF's lattice
i-quants (scheme `codebook`: `gguf/iq_blocks.py`). Each weight is one of 16 values (the checkpoint's
`quant_map`, the layer's `code`; an i-quant's grid values) times its block's scale, a float32 per output
row and block of input columns: bitsandbytes' absolute maximum of 64 (double-quantized checkpoints'
one-byte absmax are decoded to it at load), an i-quant's group scale of 16 or 32. Codes are held two a
byte, column 2j in the low nibble; activations stay as they are, or (`input_quant` mxfp4: MXFP4's W4A4) are quantized
and dequantized to MXFP4 first, and the products are taken in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_engine.model.quant import cpu_codebook, schemes
from ember_engine.model.quant.layer import QuantLinear, use_triton


class CodebookLinear(QuantLinear):
    weight_packed: torch.Tensor
    code: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, scheme: str, block: int
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if in_features % block:
            raise schemes.UnsupportedQuantizationError(
                f"{scheme}: input size {in_features} is not a multiple of the blocksize {block}"
            )
        self.scheme, self.group_size = scheme, block
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer(
            "weight_scale", torch.ones(out_features, in_features // block, dtype=torch.float32)
        )
        self.register_buffer("code", torch.zeros(16, dtype=torch.float32))
        # the CPU loops' form of the table, derived from it: each byte's two values (2 KB, not weights)
        self.code_pairs = cpu_codebook.pair_table(self.code)
        self._code_from: str | None = None

    def weight_data(self) -> torch.Tensor:
        return self.weight_packed

    def set_code(self, table: torch.Tensor, name: str) -> None:
        """A part's 16 code values; the parts of a merged projection must share them (bitsandbytes writes
        the same table for every weight of a type)."""
        table = table.float().reshape(-1)
        if table.numel() != 16 or not torch.isfinite(table).all():
            raise schemes.UnsupportedQuantizationError(
                f"{name}: quant_map must hold 16 finite values, found {table.numel()}"
            )
        if self._code_from is not None and not torch.equal(table, self.code.cpu()):
            raise schemes.UnsupportedQuantizationError(
                f"{name}: its quant_map differs from {self._code_from}'s, with which it is merged; not supported"
            )
        self._code_from = self._code_from or name
        self.code.copy_(table)
        self.code_pairs = cpu_codebook.pair_table(table)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant:
            x = schemes.fake_quantize_input(x, self.input_quant).to(x.dtype)
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.codebook_matmul(
                x, self.weight_packed, self.code, self.weight_scale, self.group_size
            )
        if x.device.type == "cpu":
            return cpu_codebook.codebook_matmul(x, self.weight_packed, self.code_pairs, self.weight_scale)
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = torch.stack([self.weight_packed & 15, self.weight_packed >> 4], dim=-1).reshape(
            self.out_features, self.in_features
        )
        scale = self.weight_scale.repeat_interleave(self.group_size, dim=1)
        return (self.code[codes.long()] * scale).to(dtype)
