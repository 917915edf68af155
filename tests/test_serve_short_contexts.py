"""A context length the cache or the user makes short is served: the server's own warm-up requests fit
inside it, whatever it is."""

from __future__ import annotations

from pathlib import Path

import plainhttp
import pytest
from server_util import running_server


@pytest.mark.parametrize(
    ("flags", "max_model_len"),
    [
        (["--max-model-len", "10"], 10),
        (["--max-model-len", "2"], 2),
        # One block of 8: the cache lowers max_model_len to 8 and says so.
        (["--num-kv-blocks", "1", "--block-size", "8"], 8),
    ],
)
def test_a_short_context_starts_and_serves(tiny_model: Path, flags: list[str], max_model_len: int) -> None:
    with running_server(tiny_model, "--served-model-name", "tiny", *flags) as s:
        (card,) = plainhttp.get(f"{s.url}/v1/models").json()["data"]
        assert card["max_model_len"] == max_model_len
        body = {"model": "tiny", "prompt": [11], "max_tokens": max_model_len - 1, "temperature": 0}
        answer = plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == max_model_len - 1
        body["max_tokens"] = max_model_len  # one token over: refused, not cut short
        refused = plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400, refused.text
