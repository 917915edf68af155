"""Incremental detokenization and stop strings.

Text is produced by decoding a short window of tokens and keeping what the newest ones added, so
multi-byte characters split across tokens and tokenizers that strip a leading space at the start of a
decode both come out right. While a request runs, the last `longest stop string - 1` characters are held
back from streaming: they may turn out to be the start of a stop string, and no text past a stop may
ever reach a client.
"""

from __future__ import annotations

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.sample.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip = params.skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0  # characters of text already handed out
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.stop_floor = 0  # stop strings are looked for from here on: not in text added without detection

    def append(self, token_id: int, detect_stop: bool = True) -> str | None:
        """Add one generated token's text; returns the stop string it completed, if any (text is then
        cut at the stop, or just after it with include_stop_str_in_output)."""
        skip, ids, tokenizer = self.skip, self.ids, self.tokenizer
        ids.append(token_id)
        start, read = self.prefix_offset, self.read_offset
        if read - start == 1:  # the usual window: the previous token alone
            before = tokenizer.decode_one(ids[start], skip)
        else:
            before = tokenizer.decode(ids[start:read], skip)
        after = tokenizer.decode(ids[start:], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += after[len(before) :]
        self.prefix_offset, self.read_offset = read, len(ids)
        if not detect_stop:
            self.stop_floor = len(self.text)
            return None
        return self._find_stop(start) if self.params.stop else None

    def _find_stop(self, new_from: int) -> str | None:
        if not self.params.stop:
            return None
        search_from = max(self.stop_floor, new_from - self.holdback)
        found: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, stop = found
        self.text = self.text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        return stop

    def flush(self) -> None:
        """At the end, keep even an incomplete trailing character."""
        tail = self.tokenizer.decode(self.ids[self.read_offset :], self.params.skip_special_tokens)
        if tail and self.read_offset < len(self.ids):
            self.text += tail
            self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """The text not yet handed out; while running, minus the stop-string holdback."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
