"""Chat messages -> prompt text, with the checkpoint's own Jinja chat template."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember_engine.core.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Templates come with checkpoints: render them sandboxed.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


@lru_cache(maxsize=8)
def template_reads_tools(source: str) -> bool:
    """Whether the template reads the `tools` variable, i.e. can show the model its tools."""
    env = ImmutableSandboxedEnvironment()
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    if not tokenizer.chat_template:
        raise ChatTemplateError("the model has no chat template (tokenizer_config.json has no chat_template)")
    extra: dict[str, Any] = {}
    if tools:
        if not template_reads_tools(tokenizer.chat_template):
            raise ChatTemplateError(
                "the model's chat template does not support tools (it never reads `tools`)"
            )
        extra["tools"] = tools
    try:
        return _compile(tokenizer.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **extra,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
