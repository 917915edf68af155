"""The checkpoint's tokenizer (`tokenizer.json`) and chat template, without transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: ember reads fast-tokenizer files (tokenizer.json)")
        self._tok = _HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        # By name: "default", and others a checkpoint names ("tool_use"), as transformers reads them.
        self.chat_templates = _chat_templates(model_dir, self.config.get("chat_template"))
        self.chat_template: str | None = self.chat_templates.get("default")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._single: dict[tuple[int, bool], str] = {}  # decode_one's texts
        self._byte_level: bool | None = None  # whether pieces spell bytes as GPT-2's printable characters

    def template_for(self, tools: bool) -> str | None:
        """The chat template a request renders with: the checkpoint's `tool_use` one for a request with
        tools where it names one (as transformers picks), else the default."""
        return self.chat_templates.get("tool_use", self.chat_template) if tools else self.chat_template

    def use_chat_template(self, source: str) -> None:
        """Render every chat with `source` (`--chat-template`), whatever the checkpoint holds."""
        self.chat_templates = {"default": source}
        self.chat_template = source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some tokenizer_config.json files ask for BOS without a post-processor that adds it.
        if (
            add_special_tokens
            and self.add_bos
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def word_sequences(self, words: list[str]) -> list[list[int]]:
        """The token sequences that spell each word, as vLLM finds them for `bad_words`: the word as it is
        (its leading spaces dropped), and after a space where that makes another first token in as many
        tokens (a word in mid-text, for tokenizers that mark a space in the token)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.encode(word.lstrip(), add_special_tokens=False)
            if not alone:  # spelled by no token: nothing to hold back
                continue
            out.append(alone)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id])`, remembered: incremental detokenization asks for it once a token."""
        key = (token_id, skip_special_tokens)
        text = self._single.get(key)
        if text is None:
            text = self._single[key] = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also where it holds only part of a character (which decodes
        alone to U+FFFD): from its piece, spelt as a byte-fallback `<0xNN>` or in byte-level characters."""
        text = self.decode_one(token_id, skip_special_tokens=False)
        piece = self._tok.id_to_token(token_id)
        if "\ufffd" not in text or piece is None:
            return text.encode()
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level is None:
            self._byte_level = '"ByteLevel"' in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode()


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes: printable Latin-1 bytes stand for themselves, the other 68 take
    the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _chat_templates(model_dir: Path, configured: object) -> dict[str, str]:
    """The checkpoint's chat templates by name: tokenizer_config.json's `chat_template` (one template, or
    a list of {name, template}), then `chat_template.jinja` as the default and each
    `additional_chat_templates/NAME.jinja`, which take precedence, as in transformers' saved layout."""
    templates: dict[str, str] = {}
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        templates["default"] = jinja.read_text()
    more = model_dir / "additional_chat_templates"
    for path in sorted(more.glob("*.jinja")) if more.is_dir() else ():
        templates[path.stem] = path.read_text()
    return templates


def _token_text(value: object) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
