"""LoRA adapters: what PEFT (the library that trains and saves them) computes on transformers is what ember
computes, each adapter in a batch that mixes them with the base model; an adapter's KV is never another's;
what ember cannot apply is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.core.kv_events import chain_hash
from ember_engine.core.scheduler import Scheduler, SchedulerOutput
from ember_engine.model.lora_files import AdapterError

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 129)]
    return [*prompts, [*prompts[4][:100], 5, 6, 7]]  # shares full blocks with the one before


PROMPTS = _prompts()


def build_adapter(base: Path, out: Path, seed: int, scale: float = 0.05, **options: object) -> Path:
    """A PEFT LoRA adapter of `base`, saved as PEFT saves one, with random (non-zero) factors of about
    `scale`."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**options))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "every-projection": build_adapter(tiny_model, root / "a", 0, r=8, lora_alpha=16, target_modules=ALL),
        # rsLoRA scaling, per-module rank and alpha, some layers and projections only
        "attention": build_adapter(
            tiny_model,
            root / "b",
            1,
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
            rank_pattern={"o_proj": 2},
            alpha_pattern={"v_proj": 32},
            layers_to_transform=[0, 2],
        ),
    }


def _peft(tiny_model: Path, adapter: Path) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


@pytest.fixture(scope="module")
def reference(tiny_model: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens per adapter (None: the base model, transformers alone)."""
    out: dict[str | None, list[list[int]]] = {
        None: hf_greedy(
            AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), PROMPTS, MAX_NEW
        )
    }
    for name, path in adapters.items():
        out[name] = hf_greedy(_peft(tiny_model, path), PROMPTS, MAX_NEW)
    return out


def test_a_batch_mixing_adapters_computes_what_peft_computes(
    tiny_model: Path, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]]
) -> None:
    names: list[str | None] = [None, *adapters]
    assert len({tuple(map(tuple, r)) for r in reference.values()}) == 3  # each adapter changes the model
    llm = LLM(str(tiny_model), dtype="float32", lora_modules={n: str(p) for n, p in adapters.items()})
    # Every prompt on every adapter and on the base model, interleaved, in one run (batched together).
    order = [(i, name) for i in range(len(PROMPTS)) for name in names]
    outs = llm.generate([PROMPTS[i] for i, _ in order], GREEDY, use_tqdm=False, lora=[n for _, n in order])
    for (i, name), out in zip(order, outs, strict=True):
        assert out.error is None, out.error
        assert out.token_ids == reference[name][i], (name, i)
    # One adapter among base-model requests (its rows only), and one adapter alone.
    for names_here in ([None, "attention"], ["every-projection"]):
        order = [(i, name) for i in range(len(PROMPTS)) for name in names_here]
        outs = llm.generate(
            [PROMPTS[i] for i, _ in order], GREEDY, use_tqdm=False, lora=[n for _, n in order]
        )
        assert [o.token_ids for o in outs] == [reference[name][i] for i, name in order]


def test_prompt_logprobs_match_peft_logits(tiny_model: Path, adapters: dict[str, Path]) -> None:
    name, path = "attention", adapters["attention"]
    llm = LLM(str(tiny_model), dtype="float32", lora_modules={name: str(path)})
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([prompt], params, use_tqdm=False, lora=name)
    ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])  # type: ignore[union-attr]
    with torch.inference_mode():
        logits = _peft(tiny_model, path)(torch.tensor([prompt])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_an_adapters_blocks_are_its_own_in_the_prefix_cache(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_model), dtype="float32", lora_modules={n: str(p) for n, p in adapters.items()})
    prompt = PROMPTS[4]  # 129 tokens: 8 full blocks
    hits = []
    for lora in (None, "attention", "every-projection", "attention", None):
        before = llm.engine.stats().prefix_cache_hits
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora=lora)
        assert out.error is None
        hits.append(llm.engine.stats().prefix_cache_hits - before)
    # Only the second run on the same adapter (or the base model) finds the first one's blocks.
    assert hits == [0, 0, 0, 128, 128]
    # The keys differ by adapter; no cache salt spells an adapter's key.
    block = prompt[:16]
    keys = {chain_hash(None, block), chain_hash(None, block, adapter="a"), chain_hash(None, block, "a")}
    keys |= {chain_hash(None, block, adapter="b"), chain_hash(None, block, "x", adapter="a")}
    assert len(keys) == 5


def test_speculation_on_an_adapter_gives_its_plain_tokens(
    tiny_model: Path, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]]
) -> None:
    # The proposals (n-gram lookup) are checked by the adapted model: greedy tokens are the adapter's.
    loras = {n: str(p) for n, p in adapters.items()}
    # Speculation at every step: the adaptive controller, timing a loaded machine, may turn it off.
    llm = LLM(
        str(tiny_model),
        dtype="float32",
        lora_modules=loras,
        speculative_method="ngram",
        speculative_adaptive=False,
    )
    repeated = [p * 3 for p in PROMPTS[:3]]  # repeats give the lookup something to propose
    plain = LLM(str(tiny_model), dtype="float32", lora_modules=loras)
    for name in ("every-projection", "attention"):
        want = plain.generate(repeated, GREEDY, use_tqdm=False, lora=name)
        got = llm.generate(repeated, GREEDY, use_tqdm=False, lora=name)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.stats().spec.num_draft_tokens > 0  # type: ignore[union-attr]
    assert (
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="attention")[0].token_ids
        == reference["attention"][0]
    )


def test_two_ranks_run_adapters_as_one(
    tiny_model: Path, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]]
) -> None:
    loras = {n: str(p) for n, p in adapters.items()}
    llm = LLM(str(tiny_model), dtype="float32", lora_modules=loras, tensor_parallel_size=2)
    try:
        names: list[str | None] = [None, *adapters]
        order = [(i, name) for i in range(len(PROMPTS)) for name in names]
        outs = llm.generate(
            [PROMPTS[i] for i, _ in order], GREEDY, use_tqdm=False, lora=[n for _, n in order]
        )
        assert [o.token_ids for o in outs] == [reference[name][i] for i, name in order]
    finally:
        llm.engine.shutdown()


def test_an_unknown_adapter_is_an_error_for_that_prompt_alone(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_model), dtype="float32", lora_modules={"attention": str(adapters["attention"])})
    good, bad = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora=["attention", "nope"])
    assert good.error is None and len(good.token_ids) == MAX_NEW
    assert bad.error == "lora: unknown adapter 'nope'; loaded: attention"
    (none,) = LLM(str(tiny_model)).generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="attention")
    assert none.error == "lora: no LoRA adapters are loaded; 'attention' is unknown"


def _edited(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _bin_only(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "adapter_model.safetensors").rename(dst / "adapter_model.bin")
    return dst


def test_what_cannot_be_applied_exactly_is_refused_by_name(
    tiny_model: Path, small_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    src = adapters["attention"]
    cases: list[tuple[Path, str]] = [
        (_edited(src, tmp_path / "dora", use_dora=True), "use_dora: True: DoRA adapters are not served"),
        (
            _edited(src, tmp_path / "bias", bias="all"),
            "bias: 'all': adapters that train biases are not served",
        ),
        (_edited(src, tmp_path / "save", modules_to_save=["lm_head"]), "modules_to_save: ['lm_head']"),
        (_edited(src, tmp_path / "alora", alora_invocation_tokens=[5, 6]), "alora_invocation_tokens: [5, 6]"),
        (_edited(src, tmp_path / "ia3", peft_type="IA3"), "peft_type: 'IA3' is not served"),
        (
            build_adapter(tiny_model, tmp_path / "head", 2, r=2, target_modules=["q_proj", "lm_head"]),
            "adapts no projection served",
        ),
        # trained on another model: layers this one lacks, or shapes that do not fit it
        (
            build_adapter(small_model, tmp_path / "deeper", 3, r=2, target_modules=["q_proj"]),
            "is for layer 4; the model has 4",
        ),
        (
            build_adapter(
                small_model, tmp_path / "wider", 3, r=2, target_modules=["q_proj"], layers_to_transform=[0]
            ),
            "model.layers.0.self_attn.q_proj has lora_A (2, 768) and lora_B (768, 2); this model needs [r, 128] "
            "and [128, r] (an adapter trained on another model?)",
        ),
        (tmp_path / "missing", "adapter_config.json not found"),
        (
            _bin_only(src, tmp_path / "bin"),
            "adapter_model.safetensors not found (files there: adapter_model.bin)",
        ),
    ]
    for path, message in cases:
        with pytest.raises(AdapterError, match="LoRA adapter 'x': ") as err:
            LLM(str(tiny_model), lora_modules={"x": str(path)})
        assert message in str(err.value), (path.name, str(err.value))


def test_an_adapter_over_quantized_weights_adds_its_product(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """Over int8 weights (w8a16) the adapted model is PEFT's within the quantization's error, and far
    from the quantized base alone: the adapter's product is added to the quantized projections' output."""
    name, path = "every-projection", adapters["every-projection"]
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    llm = LLM(str(tiny_model), dtype="float32", quantization="w8a16", lora_modules={name: str(path)})
    adapted, base = (
        torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])  # type: ignore[union-attr]
        for out in llm.generate([prompt, prompt], params, use_tqdm=False, lora=[name, None])
    )
    with torch.inference_mode():
        logits = _peft(tiny_model, path)(torch.tensor([prompt])).logits[0, :-1].float()
    peft = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    off_peft, off_base = (adapted - peft).abs().mean(), (adapted - base).abs().mean()
    # measured: 0.038 from PEFT (the int8 rounding), 0.99 from the base
    assert off_peft < 0.1 and off_base > 10 * off_peft, (off_peft, off_base)


def test_adapters_added_and_removed_offline(
    tiny_model: Path, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]]
) -> None:
    llm = LLM(str(tiny_model), dtype="float32")
    llm.add_lora("attention", str(adapters["attention"]))
    (out,) = llm.generate(PROMPTS[4:5], GREEDY, use_tqdm=False, lora="attention")
    assert out.token_ids == reference["attention"][4]
    with pytest.raises(ValueError, match="lora: adapter 'attention' is already loaded"):
        llm.add_lora("attention", str(adapters["every-projection"]))
    llm.remove_lora("attention")
    with pytest.raises(KeyError):
        llm.remove_lora("attention")
    (gone,) = llm.generate(PROMPTS[4:5], GREEDY, use_tqdm=False, lora="attention")
    assert gone.error == "lora: unknown adapter 'attention'; loaded: none"
    # The same name, other weights: its earlier blocks (still in the prefix cache) are not read.
    llm.add_lora("attention", str(adapters["every-projection"]))
    (again,) = llm.generate(PROMPTS[4:5], GREEDY, use_tqdm=False, lora="attention")
    assert again.token_ids == reference["every-projection"][4]


def test_max_loras_caps_the_adapters_of_a_step_and_the_outputs_stay_peft_s(
    tiny_model: Path, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]]
) -> None:
    """With max_loras=1 a step runs the base model and one adapter at most: requests on the other adapter
    wait for room (those behind them go ahead), and every output is what PEFT computes; with 2, both share
    steps."""
    names: list[str | None] = [None, *adapters]
    order = [(i, name) for i in range(len(PROMPTS)) for name in names]
    for cap in (1, 2):
        llm = LLM(
            str(tiny_model),
            dtype="float32",
            lora_modules={n: str(p) for n, p in adapters.items()},
            max_loras=cap,
        )
        steps = _watch_steps(llm.engine.scheduler)
        outs = llm.generate(
            [PROMPTS[i] for i, _ in order], GREEDY, use_tqdm=False, lora=[n for _, n in order]
        )
        assert [o.token_ids for o in outs] == [reference[name][i] for i, name in order]
        most = max(len(step - {0}) for step in steps)
        assert most == cap, steps
        assert any(0 in step and len(step) > 1 for step in steps)  # the base model ran beside an adapter


def _watch_steps(scheduler: Scheduler) -> list[set[int]]:
    """The adapter slots of each step the scheduler hands out from now on (0: the base model)."""
    steps: list[set[int]] = []
    schedule = scheduler.schedule

    def watched() -> SchedulerOutput:
        out = schedule()
        steps.append({r.adapter for r in out.requests})
        return out

    scheduler.schedule = watched  # type: ignore[method-assign]
    return steps


def test_max_lora_rank_refuses_a_higher_rank_at_start_and_while_serving(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    modules = {n: str(p) for n, p in adapters.items()}
    with pytest.raises(
        ValueError, match=r"^lora: adapter 'every-projection' has rank 8, over max_lora_rank 4$"
    ):
        LLM(str(tiny_model), dtype="float32", lora_modules=modules, max_lora_rank=4)
    llm = LLM(
        str(tiny_model), dtype="float32", lora_modules={"attention": modules["attention"]}, max_lora_rank=4
    )
    with pytest.raises(ValueError, match=r"has rank 8, over max_lora_rank 4$"):
        llm.add_lora("every-projection", modules["every-projection"])
    assert list(llm.engine.runner.lora.slots) == ["attention"]  # type: ignore[union-attr]
    for bad in ({"max_loras": 0}, {"max_lora_rank": 0}):
        with pytest.raises(ValueError, match=rf"^{next(iter(bad))}: must be >= 1, got 0$"):
            LLM(str(tiny_model), dtype="float32", **bad)  # type: ignore[arg-type]
