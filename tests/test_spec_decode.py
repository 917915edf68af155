"""Speculative decoding through the offline API: outputs equal to plain decoding, acceptance where it is
known, rollback, preemption and prefix caching underneath, and the metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_engine import LLM, SamplingParams
from ember_engine.core.llm_engine import LLMEngine
from ember_engine.server.metrics import EngineMetrics
from ember_engine.spec.decoder import SpecStats

K = 4
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\nimport os\nimport sys\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items",
    "x = 1\ny = 2\nx = 1\ny =",
]


def greedy(max_tokens: int = 1 + 6 * (K + 1)) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(
    model: Path, prompts: list[str], params: SamplingParams | list[SamplingParams], **options: object
) -> tuple[list[list[int]], LLMEngine]:
    llm = LLM(str(model), dtype="float32", **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    # Every block is back once the requests are done: no lookahead slot leaked.
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [list(o.token_ids) for o in outs], engine


def spec_of(engine: LLMEngine) -> SpecStats:
    spec = engine.stats().spec
    assert spec is not None
    return spec


@pytest.fixture(scope="module")
def plain(tiny_model: Path) -> list[list[int]]:
    return run(tiny_model, PROMPTS, greedy())[0]


def test_the_target_as_its_own_draft_accepts_everything(tiny_model: Path, plain: list[list[int]]) -> None:
    # max_tokens = 1 + 6 (K + 1): after the prefill's token, six verifications of exactly K proposals each.
    out, engine = run(
        tiny_model,
        PROMPTS,
        greedy(),
        draft_model=str(tiny_model),
        num_speculative_tokens=K,
        speculative_adaptive=False,
    )
    assert out == plain
    spec = spec_of(engine)
    assert spec.num_drafts == 6 * len(PROMPTS)
    assert spec.acceptance_rate == 1.0
    assert spec.mean_accepted_length == K + 1
    assert spec.accepted_per_position == [spec.num_drafts] * K


def test_ngram_proposals_leave_greedy_output_unchanged(tiny_model: Path, plain: list[list[int]]) -> None:
    out, engine = run(tiny_model, PROMPTS, greedy(), speculative_method="ngram", speculative_adaptive=False)
    assert out == plain
    spec = spec_of(engine)
    assert spec.num_drafts > 0 and spec.num_draft_tokens > 0  # the verification path ran


def test_sampling_with_the_target_as_draft_accepts_nearly_everything(tiny_model: Path) -> None:
    # p and q are the same model's distributions (up to float rounding between batch shapes), so the
    # rule min(1, p/q) accepts almost surely; a wrong ratio or a mis-aligned row would not.
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=3)
    out1, engine = run(tiny_model, PROMPTS, params, draft_model=str(tiny_model), speculative_adaptive=False)
    spec = spec_of(engine)
    assert spec.acceptance_rate is not None and spec.acceptance_rate > 0.97
    out2, _ = run(tiny_model, PROMPTS, params, draft_model=str(tiny_model), speculative_adaptive=False)
    assert out1 == out2  # seeded requests are reproducible with speculation too


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_sampling_does_not_depend_on_speculation(tiny_model: Path, method: str) -> None:
    # A seeded request's tokens are a function of its seed and the model alone: the same whether a step
    # speculated or not, and whatever was accepted.
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, ignore_eos=True, seed=11)
    expected, _ = run(tiny_model, PROMPTS, params)
    options: dict[str, object] = {"speculative_adaptive": False}
    # A one-token suffix is enough to look up, so sampled text gets n-gram proposals too.
    ngram = {"speculative_method": "ngram", "ngram_min": 1}
    options |= {"draft_model": str(tiny_model)} if method == "draft" else ngram
    out, engine = run(tiny_model, PROMPTS, params, **options)
    assert spec_of(engine).num_drafts > 0
    assert out == expected


def test_seeded_sampling_survives_preemption(tiny_model: Path) -> None:
    # Recomputed after preemption, a seeded request draws each position's token with that position's noise
    # again: the same tokens as a run with room for every sequence, with and without n-gram proposals.
    params = SamplingParams(temperature=0.9, max_tokens=50, ignore_eos=True, seed=5)
    expected, _ = run(tiny_model, PROMPTS, params)
    out, engine = run(tiny_model, PROMPTS, params, num_kv_blocks=10)
    assert engine.stats().num_preemptions > 0
    assert out == expected
    options = {"speculative_method": "ngram", "ngram_min": 1, "speculative_adaptive": False}
    out, engine = run(tiny_model, PROMPTS, params, num_kv_blocks=10, **options)
    assert engine.stats().num_preemptions > 0 and spec_of(engine).num_drafts > 0
    assert out == expected


def test_requests_that_cannot_speculate_share_the_batch(tiny_model: Path) -> None:
    # Penalties, logprobs and min_tokens keep a request on plain sampling; the others speculate alongside.
    mixed = [
        greedy(),
        SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True, min_tokens=10),
    ]
    expected, _ = run(tiny_model, PROMPTS, mixed)
    out, engine = run(tiny_model, PROMPTS, mixed, draft_model=str(tiny_model), speculative_adaptive=False)
    assert out == expected
    assert spec_of(engine).num_drafts > 0


def test_speculation_survives_preemption(tiny_model: Path) -> None:
    # 10 blocks of 16 cannot hold four sequences of ~70 tokens: requests are preempted and recomputed,
    # proposals' slots included.
    params = greedy(max_tokens=50)
    expected, _ = run(tiny_model, PROMPTS, params)
    out, engine = run(
        tiny_model, PROMPTS, params, draft_model=str(tiny_model), speculative_adaptive=False, num_kv_blocks=10
    )
    assert out == expected
    assert engine.stats().num_preemptions > 0
    ngram, engine = run(
        tiny_model, PROMPTS, params, speculative_method="ngram", speculative_adaptive=False, num_kv_blocks=10
    )
    assert ngram == expected and engine.stats().num_preemptions > 0


def test_speculation_with_prefix_cache_hits(tiny_model: Path) -> None:
    system = "# A module of small helpers.\n" * 6  # several full blocks shared by every prompt
    prompts = [system + p for p in PROMPTS]
    expected, _ = run(tiny_model, prompts, greedy(), enable_prefix_caching=False)
    llm = LLM(str(tiny_model), dtype="float32", draft_model=str(tiny_model), speculative_adaptive=False)
    first = [list(o.token_ids) for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    again = [list(o.token_ids) for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert first == expected and again == expected
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    # The draft recomputes its own KV for a cached prefix it may never have seen, and still agrees.
    assert stats.spec is not None and stats.spec.acceptance_rate == 1.0


def test_a_draft_with_another_vocabulary_is_refused(
    tiny_model: Path, small_model: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_model, draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] = 1000
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="draft_model: vocabulary size 1000"):
        LLM(str(tiny_model), draft_model=str(draft))
    with pytest.raises(ValueError, match="draft_model: is required"):
        LLM(str(tiny_model), speculative_method="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_model), speculative_method="ngram", num_speculative_tokens=0)


def test_a_draft_whose_tokenizer_json_is_only_written_otherwise_is_taken(
    tiny_model: Path, plain: list[list[int]], tmp_path: Path
) -> None:
    """The draft's tokenizer.json was compared byte for byte: the same tokenizer saved with other
    whitespace was refused as differing."""
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_model, draft)
    path = draft / "tokenizer.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data, indent=2))  # as json.dump(indent=2) re-saves it
    assert path.read_bytes() != (tiny_model / "tokenizer.json").read_bytes()
    out, engine = run(tiny_model, PROMPTS, greedy(), draft_model=str(draft), speculative_adaptive=False)
    assert out == plain and spec_of(engine).acceptance_rate == 1.0
    # A vocabulary that differs (two tokens' ids swapped; the same size) is still refused.
    vocab = data["model"]["vocab"]
    a, b = "def", "class"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data, indent=2))
    with pytest.raises(ValueError, match=r"draft_model: its tokenizer\.json differs from the target's"):
        LLM(str(tiny_model), draft_model=str(draft))


def test_speculative_options_no_proposer_uses_are_refused(tiny_model: Path) -> None:
    """They were taken and ignored: K and the n-gram bounds without a proposer, the n-gram bounds with a
    draft model."""
    with pytest.raises(ValueError, match=r"^num_speculative_tokens, ngram_max: .*nothing would use"):
        LLM(str(tiny_model), num_speculative_tokens=8, ngram_max=6)
    with pytest.raises(ValueError, match=r"^speculative_adaptive: .*nothing would use"):
        LLM(str(tiny_model), speculative_adaptive=False)
    with pytest.raises(
        ValueError, match=r"^ngram_min: is only used with speculative_method ngram, not draft"
    ):
        LLM(str(tiny_model), draft_model=str(tiny_model), ngram_min=1)
    # Unset, each has its default where a proposer uses it.
    with pytest.raises(ValueError, match="need 1 <= ngram_min <= ngram_max, got 5 and 4"):
        LLM(str(tiny_model), speculative_method="ngram", ngram_min=5)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_finished_request_leaves_the_blocks_plain_decoding_leaves_cached(
    tiny_model: Path, method: str
) -> None:
    """The tokens accepted in a request's last step (verified, their KV written) were never registered in
    the prefix cache: fewer blocks stayed cached than without speculation. Requests end by length and by a
    stop id met among the accepted proposals; no block holding the last token (no KV) is registered."""
    prompts = [p + f"# case {i}\n" for i, p in enumerate(PROMPTS * 2)]
    lengths = [20 + 5 * i for i in range(len(prompts))]
    expected, _ = run(tiny_model, prompts, [greedy(n) for n in lengths])
    stops = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop_token_ids=[out[12 + i]])
        for i, (n, out) in enumerate(zip(lengths, expected, strict=True))
    ]
    options: dict[str, object] = {"speculative_adaptive": False}
    options |= (
        {"draft_model": str(tiny_model)}
        if method == "draft"
        else {"speculative_method": "ngram", "ngram_min": 1}
    )
    for params in ([greedy(n) for n in lengths], stops):
        plain_out, plain_engine = run(tiny_model, prompts, params)
        out, engine = run(tiny_model, prompts, params, **options)
        assert out == plain_out and spec_of(engine).num_accepted_tokens > 0
        assert len(engine.block_manager.cached) == len(plain_engine.block_manager.cached)
        assert set(engine.block_manager.cached) == set(plain_engine.block_manager.cached)


def test_spec_metrics_are_exported(tiny_model: Path) -> None:
    _, engine = run(
        tiny_model, PROMPTS[:1], greedy(), draft_model=str(tiny_model), speculative_adaptive=False
    )
    metrics = EngineMetrics("tiny")
    metrics.record_stats(engine.stats())
    text = metrics.render()[0].decode()
    spec = spec_of(engine)
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(spec.num_drafts)}' in text
    assert (
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(spec.num_draft_tokens)}' in text
    )
    assert (
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(spec.num_accepted_tokens)}'
        in text
    )
    assert (
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} {float(spec.accepted_per_position[0])}'
        in text
    )
    assert 'ember:spec_decode_enabled{model_name="tiny"} 1.0' in text
    line = metrics.log_line()
    assert line is None or "acceptance" in line


def test_the_trained_draft_is_exact_and_accepted_often() -> None:
    from ember_engine.bench.spec import code_prompts
    from ember_engine.tools.spec_pair import packaged_pair

    target, draft = packaged_pair()
    prompts = code_prompts(4)
    params = greedy(max_tokens=32)
    expected, _ = run(target, prompts, params)
    out, engine = run(target, prompts, params, draft_model=str(draft), speculative_adaptive=False)
    assert out == expected
    spec = spec_of(engine)
    # Real acceptance, not a model agreeing with itself: well above what unrelated models would reach.
    assert spec.acceptance_rate is not None and spec.acceptance_rate > 0.5
    ngram, engine = run(target, prompts, params, speculative_method="ngram", speculative_adaptive=False)
    assert ngram == expected and spec_of(engine).num_drafts > 0


def test_lookahead_comes_only_from_spare_blocks_and_is_trimmed_back() -> None:
    from ember_engine.core.block_manager import BlockManager
    from ember_engine.core.request import Request
    from ember_engine.core.scheduler import Scheduler

    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = (Request(name, [1, 2, 3], SamplingParams(max_tokens=10)) for name in "ab")
    for r in (a, b):
        sched.add(r)
    out = sched.schedule()  # both prompts, one block each
    for r, n in zip(out.requests, out.num_tokens, strict=True):
        r.num_computed_tokens += n
        r.all_token_ids.append(7)  # decoding now: one known token to compute
    a.spec_lookahead = b.spec_lookahead = 4
    out = sched.schedule()
    # One free block, which neither decode needs for its own token (each fills its first block): it is
    # spare, and `a`, first in line, takes it for its lookahead; `b` gets none.
    assert out.requests == [a, b] and out.num_tokens == [5, 1]
    assert bm.num_free_blocks == 0 and sched.num_preemptions == 0
    lookahead_block = a.block_ids[-1]
    bm.trim(a, a.num_tokens)  # nothing of the proposals was kept
    assert a.block_ids != [] and lookahead_block not in a.block_ids
    assert next(iter(bm.free_queue)) == lookahead_block  # reused first


@pytest.mark.parametrize(
    ("num_blocks", "lookahead", "expected"),
    [
        (6, 1, [1, 9]),  # no block left over after b's chunk: `a` gets no lookahead
        (7, 4, [3, 9]),  # one block left over, but only two tokens of budget: `a` gets two slots
    ],
)
def test_lookahead_leaves_a_later_prompt_chunk_its_blocks_and_budget(
    num_blocks: int, lookahead: int, expected: list[int]
) -> None:
    from ember_engine.core.block_manager import BlockManager
    from ember_engine.core.request import Request
    from ember_engine.core.scheduler import Scheduler

    bm = BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=12)
    a = Request("a", list(range(10, 17)), SamplingParams(max_tokens=50), max_tokens=50)
    b = Request("b", list(range(30, 44)), SamplingParams(max_tokens=50), max_tokens=50)
    for r in (a, b):
        sched.add(r)
    out = sched.schedule()
    assert out.requests == [a, b] and out.num_tokens == [7, 5]  # b's prompt is chunked
    for r, n in zip(out.requests, out.num_tokens, strict=True):
        r.num_computed_tokens += n
    a.append_token(99)  # a decodes now; b has 9 prompt tokens left, needing two more blocks
    a.spec_lookahead = lookahead
    out = sched.schedule()
    # b gets its whole chunk of the budget and the blocks it needs; a's slots come only from what is left.
    assert out.preempted == [] and sched.num_preemptions == 0
    assert out.requests == [a, b] and out.num_tokens == expected
    assert len(b.block_ids) == 4 and bm.num_free_blocks == 0
