"""A chat request's prompt, rendered by one function for the server, /tokenize and the router (whose prefix
scores hash the tokens the engines cache): the messages, the generation prompt or the continued final
message, the request's chat_template_kwargs and its tools."""

from __future__ import annotations

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.chat import render_chat
from ember_engine.server.protocol import ChatCompletionRequest, checked_template_kwargs
from ember_engine.server.tools import ToolPlan


def chat_prompt_text(tok: Tokenizer, body: ChatCompletionRequest, tools: ToolPlan | None) -> str:
    """The prompt text; ChatTemplateError when the template cannot render it, APIError (naming the field)
    for template kwargs that clash with the server's own."""
    return render_chat(
        tok,
        body.template_messages(),
        body.add_generation_prompt,
        body.continue_final_message,
        checked_template_kwargs(body.chat_template_kwargs),
        None if tools is None else tools.tools,
    )


def chat_prompt_ids(tok: Tokenizer, body: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
    # The template writes the special tokens itself.
    return tok.encode(chat_prompt_text(tok, body, tools), add_special_tokens=False)
