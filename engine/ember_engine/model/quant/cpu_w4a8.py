"""`w4a8-fp8` on the CPU (`w4a8_linear.py`): loops compiled with numba (the options, and the vector
instructions they call, live in this file because numba's cache knows a function by its file's contents).

A weight row's code bytes stand for values of small tables: each group of input columns has its 16 E4M3
values (bytes, decoded by `cpu_decode.e4m3`, which vectorises). Where the CPU has AVX-512 (`LOOKUP16`) and
a group's bytes are a multiple of 16, the codes are looked up 16 at a time: a group's 16 values sit in one
512-bit register and `vpermps` picks 16 of them by 16 codes in one instruction (`_lookup_dot`,
`_lookup_pairs`, written as LLVM IR because numba does not emit the instruction from a loop). Elsewhere
each byte's two codes are looked up one at a time.

One activation row (with AVX-512): each weight row's tables are decoded, then its codes' values are
multiplied with the row's even and odd columns as they are looked up, never written out. Up to
`W4A8_FUSED_ROWS` rows: each weight row is decoded into a float32 row, which stays in the core's cache,
and multiplied with every activation row. Larger batches decode a block of rows for torch's float32
matmul (`cpu_decode.blocked`). Either way y = (q_x * s_x) @ (e4m3 * s2)^T in float32, the product
transformers and ModelOpt's simulation compute, the activations E4M3 under their static scale, then
decoded. On one 4096 x 14336 weight at one row (best of 7 on two cores of an AMD EPYC with AVX-512;
float32's matmul on both 8.0 ms): 19.9 ms one code at a time, 10.1 with 16 at a time
into a decoded row, 9.3 looked up into the products, 4.8 with each row's tables decoded in one loop
rather than group by group.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ember_engine.model.quant.cpu_decode import E4M3_UNIT, blocked, e4m3, fp8_dequantize
from ember_engine.model.quant.cpu_half import target_has

W4A8_FUSED_ROWS = 8
FAST = {"reassoc", "contract"}
LANES = 16  # a 512-bit register's float32 values: a group's table, and the codes looked up at once
_F32X16 = ir.VectorType(ir.FloatType(), LANES)
_I32X16 = ir.VectorType(ir.IntType(32), LANES)
_U8X16 = ir.VectorType(ir.IntType(8), LANES)


LOOKUP16 = target_has("avx512f")  # the products' choice (a test may turn it off)
# The loops' compile-time guard: where it is False their AVX-512 branches are pruned before LLVM sees them
# (numba freezes a global's value when it compiles), so they compile for any CPU.
_COMPILE16 = LOOKUP16


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


def _splat(value: int) -> ir.Constant:
    return ir.Constant(_I32X16, [value] * LANES)


def _data(context, builder, ty, value):
    return context.make_array(ty)(context, builder, value).data


def _vector(builder, pointer, index, vector_type):
    """A pointer to the `vector_type` value at element `index` of `pointer` (loads and stores through it
    may be unaligned)."""
    return builder.bitcast(builder.gep(pointer, [index]), vector_type.as_pointer())


def _looked_up(builder, table, codes):
    """The 16 values of `table` (<16 x float>) that 16 codes (<16 x i8>) pick: their low nibbles' and
    their high nibbles'."""
    permute = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F32X16, [_F32X16, _I32X16]), "llvm.x86.avx512.permvar.sf.512"
    )
    wide = builder.zext(codes, _I32X16)
    low = builder.call(permute, [table, builder.and_(wide, _splat(15))])
    return low, builder.call(permute, [table, builder.lshr(wide, _splat(4))])


@intrinsic
def _lookup_pairs(typingctx, src, start, values, vstart, out, ostart, nbytes):
    """out[ostart + 2j] = values[vstart + (src[start + j] & 15)] and out[ostart + 2j + 1] = values[vstart +
    (src[start + j] >> 4)] for j < nbytes, a multiple of 16: 16 bytes at a time, the two lookups
    interleaved back into column order."""

    def codegen(context, builder, sig, args):
        s, v, o = (_data(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))
        i64 = args[6].type
        table = builder.load(_vector(builder, v, args[3], _F32X16), align=4)
        steps = builder.sdiv(args[6], ir.Constant(i64, LANES))
        first = ir.Constant(_I32X16, [c for i in range(8) for c in (i, LANES + i)])
        second = ir.Constant(_I32X16, [c for i in range(8, LANES) for c in (i, LANES + i)])
        with cgutils.for_range(builder, steps) as loop:
            step = builder.mul(loop.index, ir.Constant(i64, LANES))
            codes = builder.load(_vector(builder, s, builder.add(args[1], step), _U8X16), align=1)
            low, high = _looked_up(builder, table, codes)
            at = builder.add(args[5], builder.add(step, step))
            builder.store(builder.shuffle_vector(low, high, first), _vector(builder, o, at, _F32X16), align=4)
            at = builder.add(at, ir.Constant(i64, LANES))
            builder.store(
                builder.shuffle_vector(low, high, second), _vector(builder, o, at, _F32X16), align=4
            )
        return context.get_dummy_value()

    return types.none(src, start, values, vstart, out, ostart, nbytes), codegen


@intrinsic
def _lookup_dot(typingctx, src, tables, even, odd, per, groups):
    """The sum over groups g and their bytes j < per (a multiple of 16) of tables[16 g + (b & 15)] *
    even[g per + j] + tables[16 g + (b >> 4)] * odd[g per + j], b = src[g per + j]: one weight row's
    product with an activation row split into its even and odd columns, in 16 float32 lanes."""

    def codegen(context, builder, sig, args):
        s, t, xe, xo = (_data(context, builder, sig.args[i], args[i]) for i in range(4))
        i64 = args[4].type
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32"
        )
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32X16, [0.0] * LANES))
        steps = builder.sdiv(args[4], ir.Constant(i64, LANES))
        with cgutils.for_range(builder, args[5]) as group:
            table = builder.load(
                _vector(builder, t, builder.mul(group.index, ir.Constant(i64, LANES)), _F32X16), align=4
            )
            base = builder.mul(group.index, args[4])
            with cgutils.for_range(builder, steps) as loop:
                at = builder.add(base, builder.mul(loop.index, ir.Constant(i64, LANES)))
                codes = builder.load(_vector(builder, s, at, _U8X16), align=1)
                low, high = _looked_up(builder, table, codes)
                x0 = builder.load(_vector(builder, xe, at, _F32X16), align=4)
                x1 = builder.load(_vector(builder, xo, at, _F32X16), align=4)
                builder.store(
                    builder.call(fma, [high, x1, builder.call(fma, [low, x0, builder.load(acc)])]), acc
                )
        lanes = builder.load(acc)
        total = builder.extract_element(lanes, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, LANES):
            total = builder.fadd(total, builder.extract_element(lanes, ir.Constant(ir.IntType(32), lane)))
        return total

    return types.float32(src, tables, even, odd, per, groups), codegen


@_compiled
def _tables(table, i, scale, values):
    """values[16 g + c] = row i's E4M3 byte for group g and code c, decoded, times `scale` (one loop over
    the row's bytes: it vectorises)."""
    for j in range(values.shape[0]):
        values[j] = e4m3(np.int32(table[i, j])) * scale


@_compiled
def _decode_row(src, table, i, scale, values, row, lookup16):
    """row[:] = weight row i's values times `scale`: its tables decoded into `values`, then each group's
    bytes' low and high codes looked up for columns 2j and 2j + 1 (16 bytes at a time with `lookup16`)."""
    groups = values.shape[0] // 16
    per = src.shape[1] // groups  # bytes a group
    _tables(table, i, scale, values)
    if _COMPILE16 and lookup16:
        srow = src[i]
        for g in range(groups):
            _lookup_pairs(srow, g * per, values, 16 * g, row, 2 * g * per, per)  # type: ignore[call-arg]
        return
    for g in range(groups):
        base = g * per
        for j in range(per):
            b = np.int32(src[i, base + j])
            row[2 * (base + j)] = values[16 * g + (b & 15)]
            row[2 * (base + j) + 1] = values[16 * g + (b >> 4)]


@_compiled
def _times_row(src, table, scale, even, odd, out):
    """One activation row, 16 codes at a time: out[0, i] = (weight row i) . x * scale[i], x given as its even
    and odd columns."""
    values = np.empty(table.shape[1], dtype=np.float32)
    groups = table.shape[1] // 16
    per = src.shape[1] // groups
    for i in range(src.shape[0]):
        _tables(table, i, E4M3_UNIT, values)
        out[0, i] = _lookup_dot(src[i], values, even[0], odd[0], per, groups) * scale[i]  # type: ignore[call-arg]


@_compiled
def _times_rows(src, table, scale, x, out, lookup16):
    """out[r, i] = x[r] . (weight row i) * scale[i]: each weight row decoded once, then multiplied with
    every activation row."""
    values = np.empty(table.shape[1], dtype=np.float32)
    row = np.empty(x.shape[1], dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, table, i, E4M3_UNIT, values, row, lookup16)
        s = scale[i]
        for r in range(x.shape[0]):
            acc = np.float32(0)
            for j in range(row.shape[0]):
                acc += row[j] * x[r, j]
            out[r, i] = acc * s


@_compiled
def _decode(src, table, scale, out, lookup16):
    """out[i] = weight row i's float32 values times scale[i]."""
    values = np.empty(table.shape[1], dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, table, i, scale[i] * E4M3_UNIT, values, out[i], lookup16)


def matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, packed: torch.Tensor, table: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """(xq * x_scale) @ (table's E4M3 values of the codes * scale per row)^T in float32 [m, n]: xq [m, k]
    E4M3 with x_scale [m, 1]; codes two a byte, packed [n, k / 2]; table [n, groups, 16] E4M3."""
    x = fp8_dequantize(xq, x_scale)
    m, n = x.shape[0], packed.shape[0]
    src = packed.contiguous().numpy()
    tables = table.contiguous().view(torch.uint8).reshape(n, -1).numpy()  # a row's groups one after another
    lookup16 = LOOKUP16 and _COMPILE16 and (src.shape[1] // table.shape[1]) % LANES == 0
    weight = (src, tables, scale.float().numpy())
    if m == 1 and lookup16:
        out = np.empty((1, n), dtype=np.float32)
        _times_row(*weight, x[:, 0::2].contiguous().numpy(), x[:, 1::2].contiguous().numpy(), out)
        return torch.from_numpy(out)
    if 0 < m <= W4A8_FUSED_ROWS:
        out = np.empty((m, n), dtype=np.float32)
        _times_rows(*weight, x.numpy(), out, lookup16)
        return torch.from_numpy(out)
    return blocked(lambda s, t, sc, o: _decode(s, t, sc, o, lookup16), weight, x)


def warm_up() -> None:
    """Compile the loops (or load them from numba's cache) before serving: each path of each size class."""
    for columns in [2 * LANES, 8] if LOOKUP16 else [8]:  # a group's bytes: a multiple of 16, or not
        table = torch.zeros(2, 1, 16, dtype=torch.float8_e4m3fn)
        for m in (1, 2, W4A8_FUSED_ROWS + 1):
            xq = torch.zeros(m, columns, dtype=torch.float8_e4m3fn)
            matmul(
                xq, torch.ones(m, 1), torch.zeros(2, columns // 2, dtype=torch.uint8), table, torch.ones(2)
            )
