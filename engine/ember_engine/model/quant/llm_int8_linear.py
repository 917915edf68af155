"""bitsandbytes' 8-bit weights as LLM.int8() runs them (`load_in_8bit`, the "...-bnb-8bit" downloads).

The weight is int8 [out, in] with its rows' absolute maxima (`SCB`): a value is q * SCB / 127. A product
goes as bitsandbytes computes it: the input is taken to float16; every input column holding a value at or
above the outlier threshold (`llm_int8_threshold`, 6.0 by default) anywhere in the batch is an outlier
column; the other values are quantized per row to int8 (round(x * 127 / absmax of the row), the outliers
zeroed first) and multiplied with the int8 weight in exact int32 sums, scaled by both rows' absolute
maxima over 127^2; the outlier columns are multiplied in the model's dtype with those columns of the
dequantized weight and added. Which columns are outliers depends on every row of the batch, so a
sequence's outputs depend on the others it is batched with (as they do under bitsandbytes).
"""

from __future__ import annotations

import torch

from ember_engine.model.quant.layer import QuantLinear

# bitsandbytes' constants: 1 / 127^2 and 1 / 127, as its kernels write them
_SCALE_SQ = 6.200124e-05
_SCALE = 7.874015718698502e-3


class LlmInt8Linear(QuantLinear):
    scheme = "bnb-int8"
    weight: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, threshold: float
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.threshold = threshold
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))  # SCB

    def weight_data(self) -> torch.Tensor:
        return self.weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        a = x.to(torch.float16)
        columns = None
        if self.threshold > 0:
            outliers = a.abs() >= self.threshold
            if outliers.any():
                columns = outliers.any(dim=0).nonzero().view(-1)
                a = a.masked_fill(outliers, 0)
        rows = a.abs().amax(dim=1).float()
        safe = torch.where(rows > 0, rows, torch.ones_like(rows))  # an all-zero row quantizes to zeros
        q = torch.round(a * (127.0 / safe[:, None])).to(torch.int8)
        if columns is not None and q.shape[0] > 1:
            q[:, columns] = 0
        y = (_int_matmul(q, self.weight) * (rows[:, None] * self.weight_scale[None, :]) * _SCALE_SQ).to(
            x.dtype
        )
        if columns is None:
            return y
        part = (self.weight[:, columns] * self.weight_scale[:, None] * _SCALE).to(x.dtype)
        return y.addmm(x[:, columns], part.t())

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight * self.weight_scale[:, None] * _SCALE).to(dtype)


def _int_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [M, K] int8 @ w [N, K]^T int8 in exact int32 sums."""
    m, k = q.shape
    if q.is_cuda and (m <= 16 or k % 8 or w.shape[0] % 8):
        return (q.double() @ w.double().t()).to(torch.int32)  # exact: |sums| < 2^53
    return torch._int_mm(q, w.t())
