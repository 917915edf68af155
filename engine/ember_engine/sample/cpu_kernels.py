"""The sampler's loops on a CPU, compiled (numba): the truncated draws of top-p, top-k and min-p rows
(weights, draws and checks of every row in one call, with no tensor operation per round), and the penalty
state's two steps (`PenaltyState` keeps the same arrays; on other devices its torch operations do the
same work), and seeded rows' exponential race with noise computed from the row's key.

They are compiled without the GIL, with sums that may be reassociated so that loops vectorise (NaN and
infinities keep their meaning), with IEEE arithmetic (a division by zero gives an infinity, as torch's
does, not an exception), and cached on disk where a cache directory can be written. The options live in
this file because numba's cache knows a function by its file's contents.

Truncated draws. A row's weights are 2^((x - max) * log2(e) / T), unnormalised (the likeliest token
weighs exactly 1), computed in the same pass that sums them by blocks of `BLOCK` tokens. The row draws
from the tokens heavier than its floor (at first 0: every token of weight) by inverting their cumulative
weight in two levels, the blocks and then the one block the draw lands in. The drawn token is kept when
it lies in the row's truncated set; otherwise its weight becomes the floor and the row draws again (see
`nucleus`). The loops are written so that the compiler vectorises them: selects instead of branches,
each block a slice (whose loop index is known to be in range), and 2^y as a polynomial times a power of
two built from its bits (torch's exp2, or a call per element, would cost a pass of its own)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

FAST = {"reassoc", "contract"}


def compiled(fn):
    """Compiled at first call, or read from numba's cache (the package's own directory, else the user's
    cache directory or NUMBA_CACHE_DIR)."""
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


BLOCK = 64
# Below 2^-126 of the likeliest token (the smallest normal float32) a weight is 0.
LOWEST = -126.0
# 2^f = e^(f ln 2) for f in [-1/2, 1/2]: its Taylor coefficients to the 7th power, whose remainder is
# under 1e-8 of the value, below float32's own rounding.
C0, C1, C2, C3 = 1.0, 0.6931471805599453, 0.2402265069591007, 0.055504108664821576
C4, C5, C6, C7 = 0.009618129107628477, 0.0013333558146428441, 0.00015403530393381606, 1.5252733804059838e-05


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@compiled
def _weigh(x, peak, scale, w, masses):
    """w = 2^((x - peak) * scale) for one row of logits, and each block's mass into `masses`; returns
    the row's mass."""
    total = np.float32(0.0)
    for b in range(masses.shape[0]):
        xs = x[b * BLOCK : (b + 1) * BLOCK]
        ws = w[b * BLOCK : (b + 1) * BLOCK]
        mass = np.float32(0.0)
        for i in range(xs.shape[0]):
            y = (xs[i] - peak) * scale
            live = y > np.float32(LOWEST)
            y = y if live else np.float32(LOWEST)
            n = np.floor(y + np.float32(0.5))
            f = y - n
            p = np.float32(C7) * f + np.float32(C6)
            p = p * f + np.float32(C5)
            p = p * f + np.float32(C4)
            p = p * f + np.float32(C3)
            p = p * f + np.float32(C2)
            p = p * f + np.float32(C1)
            p = p * f + np.float32(C0)
            v = p * _float_of_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # type: ignore[call-arg]
            v = v if live else np.float32(0.0)
            ws[i] = v
            mass += v
        masses[b] = mass
        total += mass
    return total


@compiled
def _above(w, floor):
    """The mass and the number of the weights above `floor`."""
    mass = np.float32(0.0)
    count = 0
    for i in range(w.shape[0]):
        v = w[i]
        heavier = v > floor
        mass += v if heavier else np.float32(0.0)
        count += 1 if heavier else 0
    return mass, count


@compiled
def _block_masses(w, floor, masses):
    """Each block's mass of the weights above `floor`, into `masses`; returns their sum."""
    total = np.float32(0.0)
    for b in range(masses.shape[0]):
        block = w[b * BLOCK : (b + 1) * BLOCK]
        mass = np.float32(0.0)
        for i in range(block.shape[0]):
            v = block[i]
            mass += v if v > floor else np.float32(0.0)
        masses[b] = mass
        total += mass
    return total


@compiled
def _draw(w, floor, masses, total, u):
    """The first token above `floor` whose cumulative weight passes u times `total`, their mass (the
    blocks' `masses` its parts). Should rounding leave the cumulative weight short of the target (u near
    1), the last token above the floor."""
    target = u * total
    passed = np.float32(0.0)
    last_block = -1
    short = True
    for b in range(masses.shape[0]):
        mass = masses[b]
        if mass <= np.float32(0.0):
            continue
        last_block = b
        if passed + mass > target:
            short = False
            break
        passed += mass
    start = last_block * BLOCK
    stop = min(start + BLOCK, w.shape[0])
    if short:  # the last token above the floor
        for i in range(stop - 1, start - 1, -1):
            if w[i] > floor:
                return i
    last = -1
    for i in range(start, stop):
        v = w[i]
        if v > floor:
            passed += v
            last = i
            if passed > target:
                break
    return last


@compiled
def truncated_draws(logits, peaks, scale, seed, draws, top_k, top_p, min_p, weights, out):
    """For each row of `logits` ([rows, vocab] float32; `peaks` each row's largest, `scale` log2(e) over
    its temperature), a token of its distribution cut by top-k (fewer than top_k[r] tokens more likely;
    0: no cut), top-p (the mass of the more likely tokens short of top_p[r] of the row's; 1 or more: no
    cut) and min-p (at least min_p[r] times the likeliest; 0: no cut), into `out`. The row's weights are
    left in `weights`. The uniform draws come from numba's generator (this thread's), seeded with `seed`;
    a row that makes `draws` draws without keeping one gets -1. A row without weight (logits all -inf,
    or a NaN or +inf among them) gets its first largest logit, NaN the largest, as argmax has it."""
    np.random.seed(seed)
    rows, vocab = logits.shape
    masses = np.empty(-(-vocab // BLOCK), dtype=np.float32)
    for r in range(rows):
        w = weights[r]
        total = _weigh(logits[r], peaks[r], scale[r], w, masses)
        if not total > np.float32(0.0):
            out[r] = np.argmax(logits[r])
            continue
        k = top_k[r]
        q = top_p[r] * total
        cut_p = top_p[r] < np.float32(1.0)
        cut_k = k > 0
        floor_p = min_p[r]  # the likeliest token weighs 1
        floor = np.float32(0.0)
        mass = total
        out[r] = -1
        for j in range(draws):
            if j:
                mass = _block_masses(w, floor, masses)
            token = _draw(w, floor, masses, mass, np.random.random())
            p = w[token]
            kept = p >= floor_p
            if kept and (cut_p or cut_k):
                heavier, count = _above(w, p)
                kept = (not cut_p or heavier < q) and (not cut_k or count < k)
            if kept:
                out[r] = token
                break
            # Every token no heavier than this one is out too: draw again from the heavier ones.
            floor = p


@compiled
def penalize(slots, ids, off, width, rep, out):
    """Each row of `out` (the logits) with its listed tokens (the first `width` of slot slots[r]'s list;
    ids at or past the vocabulary are unused entries) divided by rep[r] where positive and multiplied
    where negative, then less their `off`."""
    rows, vocab = out.shape
    for r in range(rows):
        dst = out[r]
        s = slots[r]
        k = rep[r]
        for j in range(width):
            t = ids[s, j]
            if t < vocab:
                # No branch on the sign, which a step's fresh logits would mispredict half the time; one of
                # the two terms is exactly 0, so this is torch's arithmetic to the bit in any order.
                v = dst[t]
                above = v if v > np.float32(0.0) else np.float32(0.0)
                dst[t] = above / k + (v - above) * k - off[s, j]


@compiled
def count(where, ids, off, pend, num, freq, slots, tokens):
    """Count each slot's sampled token: its entry (listed first if new) takes its pending penalty, and
    its next occurrence will take the frequency penalty."""
    for i in range(slots.shape[0]):
        s = slots[i]
        t = tokens[i]
        at = where[s, t]
        if at < 0:
            at = num[s]
            where[s, t] = at
            num[s] += 1
        ids[s, at] = t
        off[s, at] += pend[s, at]
        pend[s, at] = freq[s]


@intrinsic
def _bits_of_float(typingctx, x):
    """The int32 whose bits are the float32 `x`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


LN2, SQRT2 = np.float32(0.6931471805599453), np.float32(1.4142135623730951)


@compiled
def _neg_log(u):
    """-ln u for a float32 u in (0, 1), within 3e-7 of it and always above 0: u = 2^e m with m in
    [sqrt(1/2), sqrt(2)), and ln m = 2 atanh(s), s = (m - 1) / (m + 1), whose series to s^9 leaves under
    1e-8 (|s| < 0.18). Written so that a loop of it vectorises (numba's log is a call per element)."""
    bits = _bits_of_float(u)  # type: ignore[call-arg,var-annotated]
    e = np.float32((bits >> np.int32(23)) - np.int32(127))
    m = _float_of_bits((bits & np.int32(0x7FFFFF)) | np.int32(0x3F800000))
    big = m > SQRT2
    m = m * np.float32(0.5) if big else m
    e = e + np.float32(1.0) if big else e
    f = m - np.float32(1.0)
    s = f / (np.float32(2.0) + f)
    z = s * s
    series = np.float32(1.0) + z * (
        np.float32(1 / 3) + z * (np.float32(1 / 5) + z * (np.float32(1 / 7) + z * np.float32(1 / 9)))
    )
    return -(e * LN2 + np.float32(2.0) * s * series)


# SplitMix64: the i-th output of the generator started at `key` is MIX(key + i * GOLDEN). Unsigned
# constants, shifts included: numba turns uint64 combined with a signed integer into a float.
GOLDEN, MIX1, MIX2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)
S27, S30, S31, S41 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(41)
# A uniform from the top 23 bits: (2n + 1) / 2^24, exact in float32, in (0, 1) with neither end.
HALF, UNIT = np.float32(0.5), np.float32(2.0**-23)


@compiled
def keyed_race(probs, keys, out):
    """For each row of `probs` ([rows, vocab] float32, unnormalised), its exponential race into `out`:
    argmax p / E with E = -ln u, where token i's uniform u is the (i + 1)-th output of SplitMix64 started at
    the row's `keys` entry. The noise is a function of the key and the token alone, so a row's token does not
    depend on what else is in the batch nor on any generator's state. Ties and a row without mass go to the
    first token, a NaN to the first NaN, as argmax has them."""
    scores = np.empty(probs.shape[1], dtype=np.float32)
    for r in range(probs.shape[0]):
        key = keys[r]
        row = probs[r]
        for i in range(row.shape[0]):
            x = key + np.uint64(i + 1) * GOLDEN
            x = (x ^ (x >> S30)) * MIX1
            x = (x ^ (x >> S27)) * MIX2
            x = x ^ (x >> S31)
            scores[i] = row[i] / _neg_log((np.float32(x >> S41) + HALF) * UNIT)
        out[r] = np.argmax(scores)
