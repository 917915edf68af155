"""One batched sampling pass per engine step: penalties, logit biases, min_tokens' suppression, grammar
masks, logprobs, greedy and (seeded) random sampling.

The engine's sampler reads every request's parameters, penalty counts and prompt marks from a persistent
`SamplingState` on the device, so a step uploads nothing per request once the batch is unchanged. Calling
a `Sampler` with `SamplingRow`s (each with its token lists) builds a throwaway state for those rows. What
changes every step comes beside the view, only for the rows it concerns: min_tokens' suppressed ids, the
grammar states of structured-output rows and the position-keyed noise seeds of seeded rows. Unseeded rows
with top-p, top-k or min-p are drawn on a CPU by rejection against a pivot (`nucleus`); seeded rows, rows
with both top-k and top-p, and every random row on an accelerator, from the truncated distribution built
over the top-k candidates (`_probs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ember_engine.sample import nucleus, penalty_state
from ember_engine.sample.grammar import GrammarState, StepMasks, compute_masks
from ember_engine.sample.nucleus import Scratch, first_argmax, sample_truncated
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import (
    MIN_P,
    REPETITION,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    BatchView,
    SamplingState,
    _upload,
)
from ember_engine.sample.seeds import keyed_race, make_generator
from ember_engine.sample.seeds import warm_up as warm_up_keyed_race

# Top-k/top-p look at this many leading candidates (topk, not a full sort); a row whose nucleus is not
# inside them (its candidates' mass is short of top_p) falls back to sorting its whole row.
CANDIDATES = 256


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # set when params.seed is not None; owned by the request
    suppress_token_ids: Sequence[int] = ()  # e.g. EOS and stop ids while len(output) < min_tokens
    noise_seed: int | None = None  # with a generator: reseed it with this before drawing (position_seed)
    grammar: GrammarState | None = None  # structured output: tokens it forbids are never sampled


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None] | None  # None when no row asked; per row None where that row did not
    top_logprobs: list[list[tuple[int, float]]] | None  # per row its own top-k; [] for k 0 or None


def _apply_penalties(
    x: torch.Tensor, state: SamplingState, view: BatchView, scratch: Scratch
) -> torch.Tensor:
    """Repetition (over prompt and output), then frequency and presence (over the output), reading and
    rewriting only the tokens each row has seen. The result is a copy of `x` (in a reused buffer on a CPU,
    where a fresh batch-by-vocabulary tensor each step costs more in page faults than the copy itself)."""
    assert view.penalized_index is not None and view.penalized_slots is not None and state.penalties
    rep = None
    if view.repetition:
        rep = state.params.index_select(0, view.penalized_slots)[:, REPETITION : REPETITION + 1]
    penalties, slot_list, slots = state.penalties, view.penalized_slot_list, view.penalized_slots
    if view.penalized_all:
        return penalties.apply(x, slot_list, slots, rep, scratch.flat("penalized", x, 1), view.penalized_span)
    sub = penalties.apply(
        x.index_select(0, view.penalized_index), slot_list, slots, rep, None, view.penalized_span
    )
    out = scratch.get("penalized", x)
    out = x.clone() if out is None else out.copy_(x)
    return out.index_copy_(0, view.penalized_index, sub)


def _truncate_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p with one descending sort of the whole row; positions outside become -inf."""
    vocab = logits.shape[1]
    values, ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    values = values.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    # Keep a token while the mass strictly before it is short of top_p, so the head token always survives.
    # top_p == 1 skips the test: float cumsum can pass 1.0 early and would drop a tail that should stay.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, ids, values)


def _truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> torch.Tensor:
    """Top-k then top-p over the `candidates` largest logits of each row (top-k of them, no full sort).
    Rows asking for top-k at most `candidates` are exact; a top-p-only row is exact when its candidates hold
    at least top_p of its mass, and is otherwise redone with a full sort (a rare, data-dependent check)."""
    vocab = logits.shape[1]
    if candidates >= vocab:
        return _truncate_sorted(logits, top_k, top_p)
    values, ids = logits.topk(candidates, dim=-1)
    rank = torch.arange(candidates, device=logits.device).unsqueeze(0)
    values = values.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    has_k = top_k < vocab
    # Normalised as the full-row computation would: over the top-k set, or over the whole row.
    norm = torch.where(has_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1)).unsqueeze(1)
    probs = (values - norm).exp()
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    out = torch.full_like(logits, float("-inf")).scatter_(1, ids, values.masked_fill(drop, float("-inf")))
    covered = has_k | (probs.sum(dim=-1) >= top_p)
    if not bool(covered.all()):
        short = (~covered).nonzero().squeeze(1)
        out[short] = _truncate_sorted(logits[short], top_k[short], top_p[short])
    return out


def _candidates(params: Sequence[SamplingParams], vocab: int) -> int:
    ks = [p.top_k for p in params if p.top_k > 0 or p.top_p < 1.0]
    if ks and all(k > 0 for k in ks):
        return min(max(ks), vocab)
    return min(max([CANDIDATES, *ks]), vocab)


def _probs(x: torch.Tensor, p: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from (`p` its rows of the parameter tensor): temperature, then
    top-k and top-p, then min-p. A greedy row (temperature 0) keeps its logits: only its argmax matters."""
    vocab = x.shape[1]
    x = x / p[:, TEMPERATURE : TEMPERATURE + 1]
    truncating = [i for i, q in enumerate(params) if q.top_k > 0 or q.top_p < 1.0]
    if truncating:
        rows = p if len(truncating) == len(params) else p[truncating]
        top_k, top_p = rows[:, TOP_K].long(), rows[:, TOP_P]
        cut = _truncate(x if rows is p else x[truncating], top_k, top_p, _candidates(params, vocab))
        x = cut if rows is p else x.index_copy(0, _upload(truncating, torch.long, x.device), cut)
    probs = x.softmax(dim=-1)
    if any(q.min_p > 0.0 for q in params):
        floor = p[:, MIN_P : MIN_P + 1] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`_probs` for rows described by their parameters alone (speculative decoding's q and p)."""
    state = SamplingState(len(params), logits.shape[1], logits.device)
    for i, q in enumerate(params):
        state.add(i, q, None, ())
    state.params = state.host_params.to(logits.device)
    return _probs(logits, state.params[: len(params)], params)


def _inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting the cumulative distribution at a uniform draw: one random number a
    row instead of one a token."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device) * cdf[:, -1:]
    # The first token whose cumulative mass passes u has mass of its own; the clamp guards rounding.
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)


def sample_probs(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """One token per row drawn from `probs` (unnormalised is fine). A seeded row runs the exponential
    race, argmax(p / E) with E ~ Exp(1), so its token is the same whatever else shares the batch: with
    `seeds[i]` (the noise of that row's output position) on a CPU, its noise is computed from that seed
    (`seeds.keyed_race`); otherwise it is V draws from the row's own generator, first reseeded with
    `seeds[i]` when given. The other rows invert their cumulative distribution at one uniform draw each
    from the default generator."""
    dev = probs.device
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return _inverse_cdf(probs)
    keyed: dict[int, int] = {}
    if seeds is not None and dev.type == "cpu":
        keyed = {i: seed for i in seeded if (seed := seeds[i]) is not None}
    drawn = [i for i in seeded if i not in keyed]
    shared = [i for i, g in enumerate(generators) if g is None]
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=dev)
    if keyed:
        rows = list(keyed)
        tokens.index_copy_(0, _upload(rows, torch.long, dev), keyed_race(probs, rows, list(keyed.values())))
    if drawn:
        noise = torch.empty(len(drawn), probs.shape[1], device=dev, dtype=probs.dtype)
        for j, i in enumerate(drawn):
            gen = generators[i]
            seed = None if seeds is None else seeds[i]
            if seed is not None and gen is not None:
                gen.manual_seed(seed)
            noise[j].exponential_(generator=gen)
        drawn_index = _upload(drawn, torch.long, dev)
        # exponential_ may return an exact 0; 0/0 would be NaN, which argmax prefers over everything.
        picked = probs.index_select(0, drawn_index) / noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        tokens.index_copy_(0, drawn_index, picked.argmax(dim=-1))
    if shared:
        shared_index = _upload(shared, torch.long, dev)
        tokens.index_copy_(0, shared_index, _inverse_cdf(probs.index_select(0, shared_index)))
    return tokens


def sampler_peak_probe(rows: int, vocab: int, device: torch.device) -> None:
    """The sampler's most memory-hungry pass over `rows` x `vocab` (a full-row sort for top-p, noise,
    logprobs), for the memory profile before the KV cache is sized."""
    logits = torch.zeros(rows, vocab, device=device)
    top_k = torch.full((rows,), vocab, dtype=torch.long, device=device)
    probs = _truncate_sorted(logits, top_k, torch.full((rows,), 0.5, device=device)).softmax(dim=-1)
    sample_probs(probs, [make_generator(0, device)] * rows)  # seeded rows: a row of noise each
    logits.log_softmax(dim=-1).topk(min(20, vocab), dim=-1)


class Sampler:
    def __init__(self, state: SamplingState | None = None, pivot: bool = True) -> None:
        self.state = state  # the engine's persistent state; None for row-by-row calls
        # Unseeded rows drawn by rejection against a pivot (`nucleus`); False: every random row takes the
        # top-k candidates and the inverse CDF (what seeded rows and speculation use), for comparison.
        self.pivot = pivot
        self.scratch = Scratch()
        if state is not None and state.device.type == "cpu":  # the engine's: compile its loops before serving
            nucleus.warm_up()
            penalty_state.warm_up()
            warm_up_keyed_race()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput([], None, None)
        state = SamplingState(len(rows), logits.shape[1], logits.device)
        for i, r in enumerate(rows):
            state.add(i, r.params, r.generator, r.prompt_token_ids, r.output_token_ids)
        view = state.view(range(len(rows)), lambda key: (rows[0].params, None, (), ()))
        suppress = {i: r.suppress_token_ids for i, r in enumerate(rows) if r.suppress_token_ids}
        grammars = {i: r.grammar for i, r in enumerate(rows) if r.grammar is not None}
        seeds = {i: r.noise_seed for i, r in enumerate(rows) if r.noise_seed is not None}
        return self.sample(logits, state, view, suppress, grammars, seeds)

    def sample(
        self,
        logits: torch.Tensor,
        state: SamplingState,
        view: BatchView,
        suppress: Mapping[int, Sequence[int]] | None = None,
        grammars: Mapping[int, GrammarState] | None = None,
        noise_seeds: Mapping[int, int] | None = None,
        masks: StepMasks | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of `view`, then count the tokens into the state's penalty rows. Keyed by
        row: `suppress` the ids a row must not pick, `grammars` the structured-output rows' states, and
        `noise_seeds` the seeds a seeded row's noise is drawn with this step (its output position's).
        `masks`: the grammar rows' masks when already computed (else computed here from `grammars`).

        A grammar wins over min_tokens: a row whose grammar allows nothing but ids it should suppress (a
        complete answer allows only EOS) keeps them, so the request ends there rather than leave the grammar."""
        dev, vocab = logits.device, logits.shape[1]
        if masks is None and grammars:
            masks = compute_masks([grammars.get(i) for i in range(len(view.slots))])
        if masks is not None and suppress:
            row_of = {r: k for k, r in enumerate(masks.rows)}
            lifted = {i for i, ids in suppress.items() if i in row_of and masks.allows_only(row_of[i], ids)}
            suppress = {i: ids for i, ids in suppress.items() if i not in lifted}
        x = logits.float()
        if view.penalized_index is not None:
            x = _apply_penalties(x, state, view, self.scratch)
        if view.bias_index is not None and view.bias_values is not None:
            # logit_bias, sparse: one flat scatter-add of every biased row's (token, bias) pairs.
            x = x.clone().view(-1).index_add_(0, view.bias_index, view.bias_values).view_as(x)
        if view.allowed is not None:  # allowed_token_ids: the rest of those rows ruled out
            kept = x.reshape(-1).index_select(0, view.allowed[1])
            x = x.index_fill(0, view.allowed[0], float("-inf"))
            x.view(-1).index_copy_(0, view.allowed[1], kept)
        if suppress:
            flat_ids = [i * vocab + t for i, ts in suppress.items() for t in ts]
            flat = x.clone().view(-1)
            flat.index_fill_(0, _upload(flat_ids, torch.long, dev), float("-inf"))
            x = flat.view_as(x)
        if masks is not None:
            x = masks.apply(x)
        if view.all_greedy:
            tokens = first_argmax(x)
        else:
            assert view.random_index is not None
            random = view.random_index
            sub = x if len(view.random_rows) == len(view.slots) else x.index_select(0, random)
            picked = self._random(sub, state, view, noise_seeds)
            tokens = picked if sub is x else first_argmax(x).index_copy(0, random, picked)
        state.record(view, tokens)
        if not view.logprob_rows:
            return SamplerOutput(tokens.tolist(), None, None)
        return _with_logprobs(x, tokens, view)

    def _random(
        self, x: torch.Tensor, state: SamplingState, view: BatchView, noise_seeds: Mapping[int, int] | None
    ) -> torch.Tensor:
        """The random rows' tokens (`x` their logits, in `view.random_rows`' order): by rejection against a
        pivot where it applies, else from the top-k-candidate distribution (`_probs`), seeded rows by their
        exponential race."""
        if self.pivot and view.pivot_rows and view.pivot_index is None:
            return sample_truncated(x, view.pivot, self.scratch)  # every random row
        assert view.random_index is not None
        p = state.params.index_select(0, view.slot_index.index_select(0, view.random_index))
        if not self.pivot or not view.pivot_rows:  # none on an accelerator (`BatchView.pivot_rows`)
            return _drawn(x, p, view, list(range(len(view.random_rows))), noise_seeds)
        assert view.pivot_index is not None and view.other_index is not None
        picked = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        pi, oi = view.pivot_index, view.other_index
        picked.index_copy_(0, pi, sample_truncated(x.index_select(0, pi), view.pivot, self.scratch))
        others = _drawn(x.index_select(0, oi), p.index_select(0, oi), view, view.other_rows, noise_seeds)
        return picked.index_copy_(0, oi, others)


def _drawn(
    x: torch.Tensor, p: torch.Tensor, view: BatchView, among: list[int], noise_seeds: Mapping[int, int] | None
) -> torch.Tensor:
    """Rows `among` the random rows: the truncated distribution in full, then the inverse CDF (or a seeded
    row's race)."""
    rows = [view.random_rows[j] for j in among]
    probs = _probs(x, p, [view.params[i] for i in rows])
    seeds = [noise_seeds.get(i) for i in rows] if noise_seeds else None
    return sample_probs(probs, [view.generators[i] for i in rows], seeds)


def _with_logprobs(x: torch.Tensor, tokens: torch.Tensor, view: BatchView) -> SamplerOutput:
    """Logprobs (after penalties, before temperature and truncation) for the rows that asked, packed with
    every row's token into one transfer: float64 holds every token id and float32 logprob exactly."""
    rows = view.logprob_rows
    wants = [view.params[r].logprobs or 0 for r in rows]
    index = _upload(rows, torch.long, x.device)
    logprobs = x.index_select(0, index).log_softmax(dim=-1)
    chosen = tokens.index_select(0, index).unsqueeze(1)
    columns = [logprobs.gather(1, chosen).double()]
    k_max = min(max(wants), x.shape[1])
    if k_max:
        top_values, top_ids = logprobs.topk(k_max, dim=-1)
        columns += [top_ids.double(), top_values.double()]
    packed = torch.cat([tokens.double(), torch.cat(columns, dim=1).flatten()]).tolist()
    n, width = len(view.slots), 1 + 2 * k_max
    token_ids = [int(t) for t in packed[:n]]
    values: list[float | None] = [None] * n
    top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for j, (r, want) in enumerate(zip(rows, wants, strict=True)):
        line = packed[n + j * width : n + (j + 1) * width]
        values[r] = line[0]
        top[r] = [(int(line[1 + i]), line[1 + k_max + i]) for i in range(min(want, k_max))]
    return SamplerOutput(token_ids, values, top)
