"""One batched sampling pass per engine step: penalties, logprobs, greedy and (seeded) random sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ember_engine.sample.grammar import GrammarState, mask_rows
from ember_engine.sample.sampling_params import SamplingParams


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
    logprobs: list[float] | None  # None when no row asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # per row its own top-k; [] for k 0 or None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator must live on the logits' device: exponential_ refuses a generator from another one."""
    return torch.Generator(device=device).manual_seed(seed)


_U64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def child_seed(seed: int, index: int) -> int:
    """Distinct, reproducible streams for the n samples of one seeded request (sample 0 keeps the seed's
    64 bits; a negative seed is its two's complement)."""
    return seed & _U64 if index == 0 else _mix64((seed & _U64) ^ _mix64(index))


def position_seed(seed: int, position: int) -> int:
    """The seed of the noise a seeded sample's output token at `position` is drawn with. Keyed by position,
    not drawn from a running stream, so the token does not depend on how many draws came before it: a
    speculative step (proposals, verification) and a plain step pick the same token."""
    return _mix64(seed ^ _mix64(position + (1 << 40)))


def _upload(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A plain host->GPU copy makes torch synchronize the stream, i.e. wait for the queued forward pass;
    # staging through pinned memory lets the whole sampling pass queue behind it instead.
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts, built on the device from one flat upload."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    flat = [r * vocab + t for r, toks in enumerate(token_lists) for t in toks]
    if flat:
        index = _upload(flat, torch.long, device)
        counts.view(-1).scatter_add_(0, index, torch.ones(len(flat), device=device))
    return counts


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    picked = [i for i, r in enumerate(rows) if r.params.penalized]
    if not picked:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    sub_rows = [rows[i] for i in picked]

    def column(values: list[float]) -> torch.Tensor:
        return _upload(values, torch.float32, dev).unsqueeze(1)

    out_counts = _counts([r.output_token_ids for r in sub_rows], vocab, dev)
    # The prompt only matters to the repetition penalty; skip uploading it for rows that do not use one.
    prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in sub_rows]
    seen = (_counts(prompts, vocab, dev) + out_counts) > 0
    rep = column([r.params.repetition_penalty for r in sub_rows])
    freq = column([r.params.frequency_penalty for r in sub_rows])
    pres = column([r.params.presence_penalty for r in sub_rows])

    index = _upload(picked, torch.long, dev)
    sub = logits.index_select(0, index)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    return logits.index_copy(0, index, sub)


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p with one descending sort; positions outside either set become -inf."""
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


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, then top-k and top-p, then min-p.
    Speculative decoding's draft (q) and target (p) distributions are both this."""
    dev, vocab = logits.device, logits.shape[1]

    def vector(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _upload(values, dtype, dev)

    # A greedy row (temperature 0) keeps its logits: its distribution only needs the right argmax.
    x = logits / vector([p.temperature if p.temperature > 0 else 1.0 for p in params]).unsqueeze(1)

    truncating = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if truncating:
        index = vector(truncating, torch.long)
        ks = [min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in truncating]
        top_k = vector(ks, torch.long)
        top_p = vector([params[i].top_p for i in truncating])
        x = x.index_copy(0, index, _truncate(x.index_select(0, index), top_k, top_p))

    probs = x.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        floor = vector([p.min_p for p in params]).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def sample_probs(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """One token per row drawn from `probs` (unnormalised is fine) by the exponential race,
    argmax(p / E) with E ~ Exp(1). Each seeded row gets exactly V draws from its own generator (first reseeded
    with `seeds[i]` when given), so its sample sequence is the same whatever else shares the batch; the other
    rows share one draw from the default generator."""
    dev, vocab = probs.device, probs.shape[1]
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        draw = torch.empty(len(shared), vocab, device=dev).exponential_()
        noise.index_copy_(0, _upload(shared, torch.long, dev), draw)
    for i, g in enumerate(generators):
        if g is not None:
            seed = None if seeds is None else seeds[i]
            if seed is not None:
                g.manual_seed(seed)
            noise[i].exponential_(generator=g)
    # exponential_ may return an exact 0; 0/0 would be NaN, which argmax prefers over everything.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    probs = sampling_probs(logits, [r.params for r in rows])
    return sample_probs(probs, [r.generator for r in rows], [r.noise_seed for r in rows])


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        dev, vocab = logits.device, logits.shape[1]
        logits = _apply_penalties(logits.float(), rows)
        biased = [
            (i * vocab + t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()
        ]
        if biased:
            flat = logits.clone().view(-1)
            index = _upload([k for k, _ in biased], torch.long, dev)
            flat.index_add_(0, index, _upload([b for _, b in biased], torch.float32, dev))
            logits = flat.view_as(logits)

        suppressed = [i * vocab + t for i, r in enumerate(rows) for t in r.suppress_token_ids]
        if suppressed:
            flat = logits.clone().view(-1)
            flat.index_fill_(0, _upload(suppressed, torch.long, dev), float("-inf"))
            logits = flat.view_as(logits)
        logits = mask_rows(logits, [r.grammar for r in rows])

        tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            index = _upload(greedy, torch.long, dev)
            tokens.index_copy_(0, index, logits.index_select(0, index).argmax(dim=-1))
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random:
            index = _upload(random, torch.long, dev)
            picked = _sample_random(logits.index_select(0, index), [rows[i] for i in random])
            tokens.index_copy_(0, index, picked)

        wants = [r.params.logprobs for r in rows]
        if all(k is None for k in wants):
            return SamplerOutput(tokens.tolist(), None, None)

        # Logprobs describe the model's distribution after penalties, before temperature and truncation.
        logprobs = logits.log_softmax(dim=-1)
        columns = [tokens.double().unsqueeze(1), logprobs.gather(1, tokens.unsqueeze(1)).double()]
        k_max = min(max(k or 0 for k in wants), vocab)
        if k_max:
            top_values, top_ids = logprobs.topk(k_max, dim=-1)
            columns += [top_ids.double(), top_values.double()]
        # One packed transfer: float64 holds every token id and float32 logprob exactly.
        host = torch.cat(columns, dim=1).tolist()
        top: list[list[tuple[int, float]]] = []
        for want, line in zip(wants, host, strict=True):
            top.append([(int(line[2 + j]), line[2 + k_max + j]) for j in range(min(want or 0, k_max))])
        return SamplerOutput([int(line[0]) for line in host], [line[1] for line in host], top)
