"""Where a chat template comes from: tokenizer_config.json's `chat_template` (one, or a list by name),
`chat_template.jinja` and `additional_chat_templates/` (transformers' saved layout, which takes
precedence), or `--chat-template` (a file or the template itself) for `ember serve` and `ember router`
alike; transformers' own rendering is the oracle for the checkpoint's layouts."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import plainhttp
import pytest
from server_util import running_server
from transformers import AutoTokenizer

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.arg_types import chat_template
from ember_engine.server.chat import ChatTemplateError, render_chat
from ember_router import main as router_main

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
WITH_TOOLS = "[{{ tools | length }} tools]" + PLAIN


def _copy(tiny_model: Path, tmp_path: Path, configured: object = None) -> Path:
    """The tiny model with `configured` as tokenizer_config.json's chat_template (None: none at all)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("chat_template", None)
    if configured is not None:
        config["chat_template"] = configured
    path.write_text(json.dumps(config))
    return model


def test_the_saved_jinja_file_takes_precedence_as_in_transformers(tiny_model: Path, tmp_path: Path) -> None:
    model = _copy(tiny_model, tmp_path, "{{ 'from the config' }}")
    (model / "chat_template.jinja").write_text(PLAIN)
    ours = render_chat(Tokenizer(model), MESSAGES)
    theirs = AutoTokenizer.from_pretrained(model).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs == "<system>be brief<user>hi there<a>"


def test_named_templates_pick_tool_use_for_a_request_with_tools(tiny_model: Path, tmp_path: Path) -> None:
    listed = [{"name": "default", "template": PLAIN}, {"name": "tool_use", "template": WITH_TOOLS}]
    for layout in ("config", "files"):
        model = _copy(tiny_model, tmp_path / layout, listed if layout == "config" else None)
        if layout == "files":
            (model / "chat_template.jinja").write_text(PLAIN)
            (model / "additional_chat_templates").mkdir()
            (model / "additional_chat_templates" / "tool_use.jinja").write_text(WITH_TOOLS)
        tok, hf = Tokenizer(model), AutoTokenizer.from_pretrained(model)
        for tools in (None, TOOLS):
            theirs = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
            assert render_chat(tok, MESSAGES, tools=tools) == theirs, (layout, tools)
        assert render_chat(tok, MESSAGES, tools=TOOLS).startswith("[1 tools]")


def test_a_checkpoint_without_a_template_says_how_to_give_one(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"ember serve --chat-template gives one"):
        render_chat(Tokenizer(_copy(tiny_model, tmp_path)), MESSAGES)


def test_the_flag_takes_a_file_or_the_template_and_refuses_what_cannot_compile(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(PLAIN)
    assert chat_template(str(tmp_path / "t.jinja")) == chat_template(PLAIN) == PLAIN
    with pytest.raises(argparse.ArgumentTypeError, match=r"no such file, and no template"):
        chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"^the template does not compile: line 1: "):
        chat_template("{% for m in messages %}")


def test_ember_serve_and_ember_router_render_with_the_flags_template(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = _copy(tiny_model, tmp_path)  # no template of its own
    (tmp_path / "t.jinja").write_text(PLAIN)
    tok = Tokenizer(model)
    expected = tok.encode("<system>be brief<user>hi there<a>")
    with running_server(
        model, "--served-model-name", "tiny", "--chat-template", str(tmp_path / "t.jinja")
    ) as s:
        answer = plainhttp.post(f"{s.url}/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
        assert answer["tokens"] == expected
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
        assert plainhttp.post(f"{s.url}/v1/chat/completions", json=chat).json()["usage"][
            "prompt_tokens"
        ] == len(expected)
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = ["--model", str(model), "--endpoint", "http://127.0.0.1:1", "--chat-template", PLAIN]
    router = router_main.build(parser.parse_args(args))
    assert render_chat(router.tokenizer, MESSAGES) == "<system>be brief<user>hi there<a>"
