"""Structured outputs in the engine: every constrained sample parses and validates against its schema,
whether tokens come from plain sampling or from speculative verification, through preemption and prefix
caching; speculation leaves constrained greedy output exactly as without it; the masks are the same
whether computed after the forward pass (a CPU engine) or during it on a worker thread (as on a GPU); a
grammar that is complete wins over min_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from ember_engine import LLM, SamplingParams
from ember_engine.bench.schemas import SCHEMAS
from ember_engine.core.outputs import RequestOutput
from ember_engine.sample.grammar import Constraint, GrammarError

PROMPT = "Answer in JSON: "


def constrained(
    schema: dict, temperature: float = 0.0, seed: int | None = None, max_tokens: int = 160
) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        constraint=Constraint("json_schema", schema),
    )


def check_valid(outs: list[RequestOutput], schemas: list[dict]) -> int:
    """Assert every non-truncated sample validates; returns how many were truncated."""
    truncated = 0
    for out, schema in zip(outs, schemas, strict=True):
        for sample in out.outputs:
            if sample.finish_reason == "length":
                truncated += 1
                continue
            assert sample.finish_reason == "stop", sample
            jsonschema.validate(json.loads(sample.text), schema)
    return truncated


def overlapped(llm: LLM) -> LLM:
    """The engine with its grammar masks computed on a worker thread during the forward pass, as on a GPU
    (a CPU engine computes them after it)."""
    from ember_engine.sample.mask_prefetch import MaskPrefetcher

    engine = llm.engine
    engine.masks = MaskPrefetcher(engine.config.max_num_seqs, engine.model_config.vocab_size, "cuda")
    return llm


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), dtype="float32")


def test_every_bench_schema_validates_greedy_and_sampled(llm: LLM) -> None:
    schemas = SCHEMAS[:16]
    params = [constrained(s) for s in schemas] + [constrained(s, 1.0, seed=i) for i, s in enumerate(schemas)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    # A random model may write digits of a "number" until max_tokens: those end "length", never "stop".
    assert check_valid(outs, schemas + schemas) <= len(params) // 4


def test_regex_choice_and_json_object(llm: LLM) -> None:
    params = [
        SamplingParams(
            n=3, temperature=1.0, seed=3, max_tokens=40, constraint=Constraint("regex", r"[a-f]{4}-[0-9]{2}")
        ),
        SamplingParams(
            temperature=1.0, seed=4, max_tokens=40, constraint=Constraint("choice", ["red", "green"])
        ),
        SamplingParams(temperature=0.0, max_tokens=60, constraint=Constraint("json_object")),
        SamplingParams(temperature=0.0, max_tokens=20, constraint=Constraint("grammar", 'start: "a" "b"+')),
    ]
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    _, choice, obj, lark = (o.outputs[0] for o in outs)

    # n > 1: each sample has its own grammar state.
    assert len(outs[0].outputs) == 3 and len({o.text for o in outs[0].outputs}) > 1
    for sample in outs[0].outputs:
        assert re.fullmatch(r"[a-f]{4}-[0-9]{2}", sample.text) and sample.finish_reason == "stop"
    assert choice.text in ("red", "green")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"ab+", lark.text)


def test_truncation_is_reported_as_length(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    out = llm.generate(PROMPT, constrained(schema, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_a_schema_that_cannot_compile_names_the_problem(llm: LLM) -> None:
    with pytest.raises(GrammarError, match="foo"):
        llm.engine.add_request("bad", PROMPT, constrained({"type": "foo"}))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "options",
    [
        {"speculative_method": "ngram", "speculative_adaptive": False},
        {"draft_model": "SELF", "speculative_adaptive": False},
    ],
    ids=["ngram", "draft"],
)
def test_speculation_keeps_constrained_output_exact(tiny_model: Path, llm: LLM, options: dict) -> None:
    options = {k: (str(tiny_model) if v == "SELF" else v) for k, v in options.items()}
    schemas = SCHEMAS[:6]
    params = [constrained(s, max_tokens=64) for s in schemas]
    # Earlier answers in the prompt give the n-gram proposer something to propose.
    prompt = PROMPT + '{"name":"ab","age":3} {"city":"x","temperature":1.5,"unit":"celsius"} {"ok":true} '
    plain = llm.generate([prompt] * len(params), params, use_tqdm=False)
    spec_llm = overlapped(LLM(str(tiny_model), dtype="float32", **options))
    again = [constrained(s, max_tokens=64) for s in schemas]
    spec = spec_llm.generate([prompt] * len(params), again, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    check_valid(spec, schemas)
    stats = spec_llm.engine.stats().spec
    assert stats is not None and stats.num_draft_tokens > 0
    if "draft_model" in options:
        # The draft (the target itself, unconstrained) proposes what the grammar forbids: rejected.
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_preemption_and_prefix_cache_keep_grammar_state(tiny_model: Path, llm: LLM) -> None:
    # 10 blocks of 16 tokens cannot hold eight sequences of ~90: requests are preempted and recomputed.
    # The shared 40-token prompt fills two blocks that later requests find in the prefix cache.
    prompt = PROMPT + "Fill in every field of the schema and use short values. " * 3
    schemas = [SCHEMAS[11], SCHEMAS[17], SCHEMAS[31], SCHEMAS[12]] * 2
    expected = llm.generate(
        [prompt] * len(schemas), [constrained(s, max_tokens=48) for s in schemas], use_tqdm=False
    )
    small = overlapped(LLM(str(tiny_model), dtype="float32", num_kv_blocks=10))
    again = [constrained(s, max_tokens=48) for s in schemas]
    outs = small.generate([prompt] * len(schemas), again, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.block_manager.stats.hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    check_valid(outs, schemas)


def test_host_and_device_unpacking_agree() -> None:
    import numpy as np
    import torch

    from ember_engine.sample.grammar import apply_bitmask, unpack_bitmask

    packed = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, (3, 5), dtype=np.int32)
    logits = torch.zeros(4, 150)
    masked = apply_bitmask(logits, [0, 2, 3], packed)  # the host path (numpy)
    allowed = unpack_bitmask(torch.from_numpy(packed), 150)  # the device path's unpacking (torch)
    assert torch.equal(torch.isfinite(masked[[0, 2, 3]]), allowed) and torch.isfinite(masked[1]).all()
    expected = [(int(packed[0, t // 32]) >> (t % 32)) & 1 == 1 for t in range(150)]
    assert allowed[0].tolist() == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_ends_before_min_tokens_ends_the_request(llm: LLM, temperature: float) -> None:
    # min_tokens keeps EOS out while the grammar, once complete, allows nothing but EOS: the grammar wins
    # and the request ends there, short of min_tokens, with no token outside the grammar.
    eos = llm.engine.model_config.eos_token_ids
    params = [
        SamplingParams(temperature=temperature, seed=1, min_tokens=12, max_tokens=30, constraint=c)
        for c in (Constraint("choice", ["yes", "no"]), Constraint("json_schema", {"type": "boolean"}))
    ]
    outs = llm.generate([PROMPT] * 2, params, use_tqdm=False)
    for out, allowed in zip(outs, (["yes", "no"], ["true", "false"]), strict=True):
        sample = out.outputs[0]
        assert sample.text in allowed and sample.finish_reason == "stop"
        *body, last = sample.token_ids
        assert last in eos and len(body) < 12
        assert llm.tokenizer.decode(body, skip_special_tokens=False) == sample.text
    # A grammar that may go on keeps min_tokens: EOS stays out while another allowed token exists.
    longer = SamplingParams(
        temperature=temperature, seed=2, min_tokens=8, max_tokens=30, constraint=Constraint("regex", "a+")
    )
    sample = llm.generate(PROMPT, longer, use_tqdm=False)[0].outputs[0]
    assert len(sample.token_ids) >= 8 and re.fullmatch("a+", sample.text)


def test_prefetched_masks_are_the_rows_own_masks(llm: LLM) -> None:
    from ember_engine.sample.grammar import compute_masks
    from ember_engine.sample.mask_prefetch import MaskPrefetcher

    compiler = llm.engine.grammar_compiler
    states = [compiler.compile(Constraint("json_schema", s)).state() for s in SCHEMAS[:6]]
    for k, state in enumerate(states):  # each somewhere else in its grammar
        assert state.accept(compiler.tokenizer.tokenize_str('{"' if k % 2 else "{"))
    prefetcher = MaskPrefetcher(8, llm.engine.model_config.vocab_size)
    try:
        prefetcher.start(states[:5])  # the sixth was not started: computed when asked for
        rows = [None, states[2], states[0], None, states[5], states[4]]
        got = prefetcher.masks(rows)
        want = compute_masks(rows)
        assert got is not None and want is not None and got.rows == want.rows == [1, 2, 4, 5]
        assert (got.packed == want.packed).all()
        assert not (want.packed[0] == want.packed[2]).all()  # different states: different masks
        prefetcher.start(states[:3])  # in order: the buffer's own rows
        same = prefetcher.masks(states[:3])
        assert same is not None and (same.packed == compute_masks(states[:3]).packed).all()  # type: ignore[union-attr]
    finally:
        prefetcher.close()


def test_grammars_that_end_mid_batch_beside_free_rows_match_each_alone(tiny_model: Path, llm: LLM) -> None:
    # Constrained rows end at different steps while free rows go on: each row keeps its own mask (or none)
    # whatever the rows beside it, so each output is what the request gives alone, with the masks
    # computed after the forward pass or during it.
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, constraint=Constraint("choice", ["yes", "no"])),
        SamplingParams(temperature=0.0, max_tokens=24),
        constrained(SCHEMAS[2], max_tokens=40),
        SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True),
        constrained(SCHEMAS[0], temperature=1.0, seed=3, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=8, constraint=Constraint("regex", "[0-9]{3}")),
    ]
    alone = [llm.generate(PROMPT, p, use_tqdm=False)[0] for p in params]
    both = LLM(str(tiny_model), dtype="float32")
    together = both.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    together = overlapped(both).generate([PROMPT] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    lengths = {len(o.outputs[0].token_ids) for o in together}
    assert len(lengths) > 2  # the rows did end at different steps


def test_prefetched_verification_masks_are_the_walked_ones(llm: LLM) -> None:
    # Proposals the grammar allows, one it refuses, and one that ends the grammar (EOS): the masks computed
    # ahead in one call are those the state's own walk gives, and the states are left where they were.
    from ember_engine.sample.grammar import compute_masks, draft_masks
    from ember_engine.sample.mask_prefetch import MaskPrefetcher

    compiler = llm.engine.grammar_compiler
    tok = compiler.tokenizer
    eos = llm.engine.model_config.eos_token_ids[0]
    states = [compiler.compile(c).state() for c in (Constraint("choice", ["yes", "no"]),) * 3]
    states.append(compiler.compile(Constraint("json_schema", SCHEMAS[0])).state())
    drafts = [tok.tokenize_str("yes"), [*tok.tokenize_str("no"), eos], tok.tokenize_str("yeah"), []]
    drafts[3] = tok.tokenize_str('{"name":"a')
    prefetcher = MaskPrefetcher(2, llm.engine.model_config.vocab_size)  # grows to the rows asked for
    try:
        rows: list = [states[0], None, states[1], states[2], states[3]]
        proposals = [drafts[0], [5, 6], drafts[1], drafts[2], drafts[3]]
        prefetcher.start([], [(s, p) for s, p in zip(rows, proposals, strict=True) if s is not None])
        got = prefetcher.draft_masks(rows, proposals)
        want = draft_masks(rows, proposals, lambda i: None)
        assert got is not None and want is not None and got.rows == want.rows
        assert len(got.rows) == sum(1 + len(p) for s, p in zip(rows, proposals, strict=True) if s is not None)
        assert (got.packed == want.packed).all()
        for state in states:  # nothing was kept
            assert not state.finished
            fresh = compute_masks([state])
            assert fresh is not None and not (fresh.packed == 0).all()
    finally:
        prefetcher.close()
