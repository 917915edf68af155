"""Chat messages -> prompt text, with the checkpoint's own Jinja chat template."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
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


def render_chat(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    if not tokenizer.chat_template:
        raise ChatTemplateError("the model has no chat template (tokenizer_config.json has no chat_template)")
    try:
        return _compile(tokenizer.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
