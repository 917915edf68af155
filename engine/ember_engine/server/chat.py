"""Chat messages -> prompt text, with the checkpoint's own Jinja chat template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember_engine.core.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param  # the request field at fault


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """`tojson` as transformers gives it to chat templates (so as the models were trained on, and as vLLM
    renders): the text as it is, keys in their order; Jinja's own escapes HTML and sorts the keys."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Templates come with checkpoints: render them sandboxed, in the environment transformers gives them.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@lru_cache(maxsize=8)
def template_reads_tools(source: str) -> bool:
    """Whether the template reads the `tools` variable, i.e. can show the model its tools."""
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    extra: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text. `continue_final_message`: end the text inside the last message (no end-of-turn
    after it, no generation prompt), so the model continues it; `extra`: the request's
    chat_template_kwargs, as more template variables; `tools`: the request's tools, for a template that reads
    them."""
    template = tokenizer.template_for(bool(tools))
    if not template:
        raise ChatTemplateError(
            "the model has no chat template (none in tokenizer_config.json or chat_template.jinja; "
            "ember serve --chat-template gives one)"
        )
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
    if tools and not template_reads_tools(template):
        raise ChatTemplateError(
            "the model's chat template does not support tools (it never reads `tools`)", param="tools"
        )
    try:
        variables: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
        variables |= extra or {}  # as vLLM: the request's kwargs win, except the messages and tokens
        if tools:
            variables["tools"] = tools
        variables |= {
            "messages": messages,
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or "",
        }
        text = _compile(template).render(**variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    if not continue_final_message:
        return text
    final = messages[-1]["content"]
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message must have text to continue")
    return text[: at + len(final)]
