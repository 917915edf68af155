"""A GGUF file's own tokenizer (`model/gguf/vocab.py`): built from the vocabulary the file carries, it
encodes as the tokenizer the file was written from does. The oracles: the source `tokenizer.json` for
byte-level BPE (GPT-2's and Llama 3's pre-tokenizers), SentencePiece itself for a SentencePiece BPE model
with byte fallback, stored as llama.cpp's converter stores them."""

from __future__ import annotations

import inspect
import io
import json
import shutil
from pathlib import Path

import gguf as gguf_package
import openai
import pytest
from server_util import running_server

from ember_engine import LLM, SamplingParams
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.model import gguf
from ember_engine.model.gguf import vocab as gguf_vocab
from ember_engine.server.chat import render_chat
from ember_router.main import _tokenizer_dir

BUILD = "gguf_build.py"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


def corpus() -> list[str]:
    """Python source in 400-character pieces (code, prose, digits, runs of spaces and newlines) and texts
    at the edges: leading and trailing spaces, tabs, long numbers, contractions, non-ASCII text."""
    import argparse
    import difflib
    import textwrap

    source = "".join(inspect.getsource(m) for m in (textwrap, difflib, argparse))
    pieces = [source[i : i + 400] for i in range(0, 60_000, 400)]
    return [
        *pieces,
        "  two leading",
        "trailing   ",
        "\n\n\tx",
        "12345 678 9",
        "it's I'LL we've THEY'D",
        "héllo wörld 日本語 🙂",
        "x",
        " ",
        "a  b   c",
    ]


def _write(path: Path, model: str, tokens: list[str], types: list[int], **fields) -> Path:  # type: ignore[no-untyped-def]
    w = gguf_package.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in fields.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_level_file(spec: dict, path: Path, pre: str, **fields) -> Path:  # type: ignore[no-untyped-def]
    """A vocabulary as llama.cpp's converter writes a byte-level BPE tokenizer.json's."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(spec))
    n = tok.get_vocab_size()
    added = {a["id"]: a["special"] for a in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return _write(
        path,
        "gpt2",
        [tok.id_to_token(i) for i in range(n)],
        [(3 if added[i] else 4) if i in added else 1 for i in range(n)],
        tokenizer_pre=pre,
        token_merges=merges,
        bos_token_id=0,
        eos_token_id=1,
        **fields,
    )


# tokenizer.ggml.pre -> how the tokenizer.json of a model of that kind spells its pre-tokenizer (the
# pattern, or GPT-2's ByteLevel regex where None) and whether its BPE takes a word that is a token whole;
# and whether llama.cpp adds BOS where the file does not say.
KINDS = {
    "gpt-2": (None, False, False),
    "llama-bpe": (gguf_vocab.LLAMA3_REGEX, True, True),
    "smaug-bpe": (gguf_vocab.LLAMA3_REGEX, False, False),
    "qwen2": (gguf_vocab.QWEN2_REGEX, False, False),
    "tekken": (gguf_vocab.TEKKEN_REGEX, True, True),
}


def _split_style(spec: dict, pre: str) -> dict:
    """The same vocabulary and merges under the pre-tokenizer of `pre`'s kind, as its tokenizer.json
    spells it."""
    spec = json.loads(json.dumps(spec))
    regex, whole, _ = KINDS[pre]
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    spec["model"]["ignore_merges"] = whole
    return spec


def _built(path: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    files = gguf_vocab.tokenizer_files(gguf.reader_of(path), path)
    return Tokenizer.from_str(files["tokenizer.json"].decode()), json.loads(files["tokenizer_config.json"])


@pytest.mark.parametrize("pre", list(KINDS))
def test_byte_level_tokenizer_encodes_as_its_source(pre: str, tmp_path: Path, tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    spec = json.loads((tiny_model / "tokenizer.json").read_text())
    if pre != "gpt-2":
        spec = _split_style(spec, pre)
    source = Tokenizer.from_str(json.dumps(spec))
    mine, config = _built(_byte_level_file(spec, tmp_path / "v.gguf", pre))
    texts = [*corpus(), "a<|eos|>b", "<|user|>hi<|end|>"]
    for text in texts:
        ids = source.encode(text).ids
        assert mine.encode(text).ids == ids, (pre, text)
        assert mine.decode(ids, skip_special_tokens=False) == source.decode(ids, skip_special_tokens=False)
    other = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))  # the pre-tokenizers do differ here
    assert (sum(other.encode(t).ids != source.encode(t).ids for t in texts) > len(texts) // 2) == (
        pre != "gpt-2"
    )
    # llama.cpp adds BOS for Llama 3's family and Tekken unless the file says otherwise; for the others, where
    # it says so
    assert (config["add_bos_token"], config["bos_token"], config["eos_token"]) == (
        KINDS[pre][2],
        "<|bos|>",
        "<|eos|>",
    )
    _, config = _built(_byte_level_file(spec, tmp_path / "w.gguf", pre, add_bos_token=False))
    assert config["add_bos_token"] is False


def _sentencepiece(dummy_prefix: bool):  # type: ignore[no-untyped-def]
    """A SentencePiece BPE model trained as Llama's was (byte fallback, digits split, no normalization)."""
    import argparse
    import collections

    import sentencepiece as spm

    text = inspect.getsource(argparse) + inspect.getsource(collections)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_writer=out,
        vocab_size=1500,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        add_dummy_prefix=dummy_prefix,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def _sentencepiece_file(sp, path: Path, **fields) -> Path:  # type: ignore[no-untyped-def]
    """As llama.cpp's converter stores a SentencePiece model: pieces, scores and types."""
    n = sp.get_piece_size()
    kinds = [
        2
        if sp.is_unknown(i)
        else 3
        if sp.is_control(i)
        else 5
        if sp.is_unused(i)
        else 6
        if sp.is_byte(i)
        else 1
        for i in range(n)
    ]
    return _write(
        path,
        "llama",
        [sp.id_to_piece(i) for i in range(n)],
        kinds,
        token_scores=[sp.get_score(i) for i in range(n)],
        bos_token_id=sp.bos_id(),
        eos_token_id=sp.eos_id(),
        unk_token_id=sp.unk_id(),
        **fields,
    )


@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_sentencepiece_tokenizer_encodes_as_sentencepiece(dummy_prefix: bool, tmp_path: Path) -> None:
    sp = _sentencepiece(dummy_prefix)
    fields = {} if dummy_prefix else {"add_space_prefix": False}
    mine, config = _built(_sentencepiece_file(sp, tmp_path / "s.gguf", **fields))
    fallback = 0
    for text in corpus():
        ids = sp.encode(text)
        assert mine.encode(text).ids == ids, text
        assert mine.decode(ids) == sp.decode(ids), text
        fallback += any(sp.is_byte(i) for i in ids)
    assert fallback >= 1  # the non-ASCII text needs byte pieces
    assert (config["add_bos_token"], config["bos_token"], config["eos_token"], config["unk_token"]) == (
        True,
        "<s>",
        "</s>",
        "<unk>",
    )


def test_merges_by_score_take_the_best_token_first() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0, 0.0]
    got = gguf_vocab.merges_by_score(tokens, scores, [1, 1, 1, 1, 1, 1, 3])
    assert got == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


@pytest.mark.parametrize(
    "case,error",
    [
        ("bert", r"tokenizer model 'bert' \(tokenizer.ggml.model\) is not supported; supported: gpt2, llama"),
        (
            "deepseek-llm",
            r"pre-tokenizer 'deepseek-llm' \(tokenizer.ggml.pre\) is not supported; supported: gpt-2, llama3",
        ),
        ("default", r"pre-tokenizer 'default' \(tokenizer.ggml.pre\) is not supported"),
        ("no_merges", r"a gpt2 tokenizer needs its merges \(tokenizer.ggml.merges\)"),
        ("no_scores", r"a llama tokenizer needs a score per token \(tokenizer.ggml.scores\)"),
        ("add_eos", r"tokenizer.ggml.add_eos_token is true, and ember does not end prompts with EOS"),
        ("types", r"2 token types \(tokenizer.ggml.token_type\) for 3 tokens"),
    ],
)
def test_what_cannot_be_read_is_refused_by_name(case: str, error: str, tmp_path: Path) -> None:
    path = tmp_path / "v.gguf"
    tokens, types = ["a", "b", "ab"], [1, 1, 1]
    if case in ("bert", "no_scores"):
        _write(path, "llama" if case == "no_scores" else case, tokens, types)
    elif case == "no_merges":
        _write(path, "gpt2", tokens, types, tokenizer_pre="gpt-2")
    elif case == "types":
        _write(path, "gpt2", tokens, [1, 1], tokenizer_pre="gpt-2", token_merges=["a b"])
    elif case == "add_eos":
        _write(path, "gpt2", tokens, types, tokenizer_pre="gpt-2", token_merges=["a b"], add_eos_token=True)
    else:
        pre = {"default": {}}.get(case, {"tokenizer_pre": case})
        _write(path, "gpt2", tokens, types, token_merges=["a b"], **pre)
    with pytest.raises(gguf.GGUFError, match=error + "(.*give the base model's tokenizer)?"):
        gguf_vocab.tokenizer_files(gguf.reader_of(path), path)


def test_a_file_alone_runs_with_its_own_tokenizer(quantized_model, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    """A file with no tokenizer directory beside it and none given: its prompts encode, its outputs decode
    and its chat template reads as with the base model's tokenizer."""
    alone = tmp_path / "alone" / "model.gguf"
    alone.parent.mkdir()
    shutil.copy(quantized_model("tiny", "Q8_0", BUILD) / "model.gguf", alone)
    own = LLM(str(alone), num_kv_blocks=32, max_num_seqs=2)
    base = LLM(str(alone), tokenizer=str(tiny_model), num_kv_blocks=32, max_num_seqs=2)
    # the router in front of the engines reads the same tokenizer from the file (`ember router --model F`)
    routers = Tokenizer(_tokenizer_dir(str(alone), None))
    for text in corpus()[:40]:
        assert own.tokenizer.encode(text) == base.tokenizer.encode(text) == routers.encode(text)
    assert own.tokenizer.chat_template == base.tokenizer.chat_template
    assert own.tokenizer.chat_template
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["def main():", "The quick brown"]
    mine = own.generate(prompts, params, use_tqdm=False)
    theirs = base.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.text) for o in mine] == [(o.token_ids, o.text) for o in theirs]
    messages = [{"role": "user", "content": "Hi"}]
    prompt = base.tokenizer.encode(render_chat(base.tokenizer, messages), add_special_tokens=False)
    expected = base.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    with running_server(alone, "--served-model-name", "alone") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
        chat = client.chat.completions.create(model="alone", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
    assert chat.choices[0].message.content == expected[0].text
