"""Offline API: `LLM(model=DIR, **options).generate(prompts, params)`, and `.chat(messages, params)`."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from ember_engine.core.adapter_updates import add_adapter, remove_adapter
from ember_engine.core.config import EngineConfig
from ember_engine.core.llm_engine import LLMEngine
from ember_engine.core.outputs import RequestOutput
from ember_engine.model.lora_files import read_adapter
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.server import generation_defaults
from ember_engine.server.chat_prompt import chat_prompt_ids
from ember_engine.server.protocol import APIError, ChatCompletionRequest
from ember_engine.server.tools import plan_tools

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, generation_config: str = "auto", **options: Any) -> None:
        """`generation_config`: where the sampling defaults of `get_default_sampling_params` come from, as
        `ember serve --generation-config` takes it (auto: the model's generation_config.json; none)."""
        self.engine = LLMEngine(EngineConfig(model=str(model), **options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._defaults = generation_defaults.read(generation_config, self.engine.config.model, None)

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters of a prompt given none: the model's recommended `temperature`, `top_p`, `top_k`,
        `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`), the rest SamplingParams'."""
        return SamplingParams(**self._defaults)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | Sequence[str | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`generate` over conversations (one, or a list of them), each rendered as `/v1/chat/completions`
        renders its messages (the model's chat template, or `chat_template`'s); ValueError naming what
        cannot be rendered."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        tok = self.tokenizer
        if chat_template is not None:
            tok = copy.copy(tok)
            tok.use_chat_template(chat_template)
        prompts: list[Prompt] = []
        for conversation in conversations:
            body = {
                "model": "-",
                "messages": conversation,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                "chat_template_kwargs": chat_template_kwargs,
                "tools": tools,
            }
            try:
                request = ChatCompletionRequest.model_validate(body)
                request.to_sampling_params()  # its own checks of the rendering options
                prompts.append(chat_prompt_ids(tok, request, plan_tools(tools, None, None)))
            except (ValidationError, APIError) as exc:
                raise ValueError(f"messages: {exc}") from None
        return self.generate(prompts, params, use_tqdm, lora=lora)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, in order; each on the base model or on the LoRA adapter `lora`
        names (one name for all, or one per prompt; adapters are given as `LLM(..., lora_modules={name:
        directory})`). A prompt that can never be served (too long, empty, an unknown adapter) comes back
        with `.error` set and no samples; the others are unaffected."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"params: {len(params_list)} given for {len(prompt_list)} prompts")
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora: {len(loras)} given for {len(prompt_list)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, sp) in enumerate(zip(prompt_list, params_list, strict=True)):
            rid = f"offline-{next(self._ids)}"
            order.append(rid)
            try:
                self.engine.add_request(
                    rid, prompt, sp, priority=priority[i] if priority else 0, lora=loras[i]
                )
            except ValueError as exc:
                token_ids = prompt if isinstance(prompt, list) else []
                text = prompt if isinstance(prompt, str) else None
                results[rid] = RequestOutput(rid, text, token_ids, [], finished=True, error=str(exc))
        self._run(results, len(order), use_tqdm)
        return [results[rid] for rid in order]

    def add_lora(self, name: str, path: str) -> None:
        """Load LoRA adapter `name` from its PEFT directory, for the prompts that follow to name."""
        add_adapter(self.engine, read_adapter(name, path, self.engine.model_config))

    def remove_lora(self, name: str) -> None:
        """Unload LoRA adapter `name` (KeyError if it is not loaded)."""
        remove_adapter(self.engine, name)

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        from tqdm import tqdm

        bar = tqdm(
            total=total, desc="requests", disable=not use_tqdm, initial=len(results), dynamic_ncols=True
        )
        start, tokens = time.perf_counter(), 0
        with bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    tokens += sum(len(o.delta_token_ids) for o in out.outputs)
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} output tok/s")
