"""The offline API's `LLM.chat` (a conversation, or several, rendered as the chat endpoint renders them;
transformers' `apply_chat_template` is the oracle for the tokens) and its sampling defaults from the model's
generation_config.json (`get_default_sampling_params`, what `generate` uses when given no parameters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ember_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ONE = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
TWO = [
    {"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "text", "text": " to three"}]}
]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), dtype="float32")


def test_chat_renders_as_transformers_and_generates_as_generate(tiny_model: Path, llm: LLM) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_model)
    outs = llm.chat([ONE, TWO], GREEDY, use_tqdm=False)
    for conversation, out in zip((ONE, TWO), outs, strict=True):
        flat = [
            {**m, "content": "".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list)
            else m
            for m in conversation
        ]
        theirs = hf.apply_chat_template(flat, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert out.prompt_token_ids == list(theirs["input_ids"])
        (again,) = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)
        assert out.token_ids == again.token_ids and len(out.token_ids) == 4
    (single,) = llm.chat(ONE, GREEDY, use_tqdm=False)  # one conversation: one output
    assert single.prompt_token_ids == outs[0].prompt_token_ids


def test_chat_options_and_refusals(llm: LLM) -> None:
    (plain,) = llm.chat(
        ONE, GREEDY, use_tqdm=False, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert plain.prompt_token_ids == llm.tokenizer.encode("be briefhi there", add_special_tokens=False)
    (open_turn,) = llm.chat(ONE, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert llm.tokenizer.decode(open_turn.prompt_token_ids, skip_special_tokens=False).endswith(
        "hi there<|end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ValueError, match=r"does not support tools"):
        llm.chat(ONE, GREEDY, use_tqdm=False, tools=tools)
    with pytest.raises(ValueError, match=r"continue_final_message"):
        llm.chat(ONE, GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match=r"^messages: "):
        llm.chat([{"role": "user"}], GREEDY, use_tqdm=False)


def test_generate_without_parameters_samples_as_the_model_recommends(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    path = model / "generation_config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "top_k": 1, "temperature": 0.7, "max_new_tokens": 5})
    )
    llm = LLM(str(model), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.7, 5)
    (greedy,) = llm.generate(["once upon"], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    (recommended,) = llm.generate(["once upon"], use_tqdm=False)  # top_k 1: greedy at any temperature
    assert recommended.token_ids == greedy.token_ids
    plain = LLM(str(model), dtype="float32", generation_config="none").get_default_sampling_params()
    assert (plain.top_k, plain.temperature, plain.max_tokens) == (SamplingParams().top_k, 1.0, 16)
