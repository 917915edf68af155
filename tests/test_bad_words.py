"""`bad_words` (vLLM's extension): a word's last token is held back wherever the output so far ends with
its other tokens, for the word as written and after a space (vLLM's two spellings), so no output holds it;
refused by name when not a list of words. The field was ignored with a warning before."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_engine import LLM, SamplingParams
from ember_engine.core.request import Request

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def _holds(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_held_back_tokens_follow_the_output_so_far() -> None:
    """Pure: a one-token word always; a longer one only where the output ends with its other tokens (the
    prompt's tokens do not count, as in vLLM)."""
    req = Request("r", [5, 6], SamplingParams(max_tokens=10, bad_words=["x"]), eos_token_ids=(2,))
    req.bad_words = [[9], [5, 6, 7], [3, 4]]
    assert req.suppressed_token_ids() == [9]  # [5, 6] is the prompt's, not the output's
    for token in (1, 3):
        req.append_token(token)
    assert req.suppressed_token_ids() == [9, 4]
    req.append_token(5)
    req.append_token(6)
    assert req.suppressed_token_ids() == [9, 7]
    # where they would hold back every id allowed_token_ids allows, the set wins
    only = Request("r", [1], SamplingParams(max_tokens=4, allowed_token_ids=[9]), eos_token_ids=(2,))
    only.bad_words = [[9]]
    assert only.suppressed_token_ids() == []


def test_a_word_the_model_would_say_is_never_said(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32")
    tok = llm.engine.tokenizer
    prompt = [11, 200, 3000, 45]
    (free,) = llm.generate([prompt], SamplingParams(**GREEDY))  # type: ignore[arg-type]
    first, second = free.token_ids[0], free.token_ids[1]
    # a word of the greedy output's first token, and one of its first two tokens
    for word_ids in ([first], [first, second]):
        word = tok.decode(word_ids)
        sequences = tok.word_sequences([word])
        (out,) = llm.generate([prompt], SamplingParams(bad_words=[word], **GREEDY))  # type: ignore[arg-type]
        assert out.token_ids != free.token_ids
        assert not any(_holds(out.token_ids, s) for s in sequences), (word, sequences, out.token_ids)
    # with a draft model such a request is sampled plainly, and the word still never comes
    spec = LLM(str(tiny_model), dtype="float32", draft_model=str(tiny_model), speculative_adaptive=False)
    word = tok.decode([first])
    (out,) = spec.generate([prompt], SamplingParams(bad_words=[word], **GREEDY))  # type: ignore[arg-type]
    assert not any(_holds(out.token_ids, s) for s in tok.word_sequences([word]))


def test_both_spellings_of_a_word_are_held_back(tiny_model: Path) -> None:
    tok = LLM(str(tiny_model), dtype="float32").engine.tokenizer
    sequences = tok.word_sequences(["hello"])
    assert sequences[0] == tok.encode("hello", add_special_tokens=False)
    spaced = tok.encode(" hello", add_special_tokens=False)
    if spaced[0] != sequences[0][0] and len(spaced) == len(sequences[0]):
        assert sequences == [sequences[0], spaced]
    else:
        assert sequences == [sequences[0]]


@pytest.mark.parametrize("value", [[""], ["  "], "word", [3]])
def test_not_a_list_of_words_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"^bad_words: must be a list of words"):
        SamplingParams(bad_words=value)  # type: ignore[arg-type]
