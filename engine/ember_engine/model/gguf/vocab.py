"""A GGUF file's own tokenizer: `tokenizer.json` and `tokenizer_config.json` written from the vocabulary
the file carries (`tokenizer.ggml.*`), for a file served without its base model's tokenizer files.

Two of llama.cpp's tokenizer models are read, with llama.cpp's rules for them (`llama-vocab.cpp`):
- "gpt2": byte-level BPE, the tokens and `merges` as stored. The pre-tokenizer is the one
  `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`): "gpt-2" (GPT-2's pattern), Llama 3's family
  ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", ...: Llama 3's pattern, a word that is itself
  a token taken whole, BOS added unless the file says otherwise), "smaug-bpe" (Llama 3's pattern alone),
  "tekken" (Mistral Nemo's: its pattern, whole words, BOS) or Qwen2's ("qwen2", "deepseek-r1-qwen": Qwen2's
  pattern). Another pre-tokenizer is refused by name.
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral). The file has scores, not merges: two
  pieces merge where their concatenation is a token, the highest-scoring such token first, as llama.cpp's
  tokenizer does; a space is put before the text unless `tokenizer.ggml.add_space_prefix` is false, and
  spaces are written "▁".
Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens."""

from __future__ import annotations

import json
from typing import Any

from ember_engine.model.gguf import GGUFError, field

CONTROL, USER_DEFINED = 3, 4
# The pre-tokenizer patterns of Llama 3's, Qwen2's and Mistral's Tekken tokenizer.json (digits one to
# three at a time; one at a time; one at a time, and words split where lower case turns upper).
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (pattern, None for GPT-2's own; whether a word that is itself a token is taken
# whole; whether BOS is added where the file does not say), as llama.cpp reads each name.
PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {"gpt-2": (None, False, False)}
PRE_TOKENIZERS |= {
    k: (LLAMA3_REGEX, True, True)
    for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
}
PRE_TOKENIZERS |= {"smaug-bpe": (LLAMA3_REGEX, False, False), "tekken": (TEKKEN_REGEX, True, True)}
PRE_TOKENIZERS |= {k: (QWEN2_REGEX, False, False) for k in ("qwen2", "deepseek-r1-qwen")}
SPACE = "\u2581"  # SentencePiece's "▁"


def has_tokenizer(reader: Any) -> bool:
    return field(reader, "tokenizer.ggml.model") is not None


def tokenizer_files(reader: Any, path: Any) -> dict[str, bytes]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} for the file's vocabulary."""
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{path}: the file's tokenizer has no tokens (tokenizer.ggml.tokens)")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(
            f"{path}: {len(types)} token types (tokenizer.ggml.token_type) for {len(tokens)} tokens"
        )
    if kind == "gpt2":
        tok, add_bos = _byte_level(reader, path, tokens)
    elif kind == "llama":
        tok, add_bos = _sentencepiece(reader, path, tokens, types)
    else:
        raise GGUFError(
            f"{path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; supported: gpt2, llama; "
            "give the base model's tokenizer (--tokenizer DIR)"
        )
    if field(reader, "tokenizer.ggml.add_eos_token"):
        raise GGUFError(
            f"{path}: tokenizer.ggml.add_eos_token is true, and ember does not end prompts with EOS; "
            "give the base model's tokenizer (--tokenizer DIR)"
        )
    _add_special(tok, tokens, types)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    for name in ("bos", "eos", "unknown", "padding"):
        i = field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            config[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = tokens[i]
    if add_bos and "bos_token" not in config:
        raise GGUFError(f"{path}: the file's tokenizer adds BOS but names none (tokenizer.ggml.bos_token_id)")
    template = field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
    }


def _byte_level(reader: Any, path: Any, tokens: list[str]) -> tuple[Any, bool]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(
            f"{path}: a gpt2 tokenizer needs its merges (tokenizer.ggml.merges); the file has none"
        )
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}; give the base model's tokenizer (--tokenizer DIR)"
        )
    pattern, whole, bos = PRE_TOKENIZERS[pre]
    vocab = ids_of(tokens)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=whole))
    if pattern is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok, bool(field(reader, "tokenizer.ggml.add_bos_token", bos))


def _sentencepiece(reader: Any, path: Any, tokens: list[str], types: list[int]) -> tuple[Any, bool]:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = field(reader, "tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFError(f"{path}: a llama tokenizer needs a score per token (tokenizer.ggml.scores)")
    vocab = ids_of(tokens)
    unk = field(reader, "tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(
        models.BPE(
            vocab,
            merges_by_score(tokens, scores, types),
            unk_token=tokens[unk] if 0 <= unk < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok, bool(field(reader, "tokenizer.ggml.add_bos_token", True))


def merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal token into two tokens, the highest-scoring token's splits first (for equal
    scores, the lower id first; a token's splits, the shorter left piece first)."""
    ids = ids_of(tokens)
    found = []
    for i, piece in enumerate(tokens):
        if types[i] != 1:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def ids_of(tokens: list[str]) -> dict[str, int]:
    """Each token's id; a token listed twice, its first."""
    return {t: i for i, t in reversed(list(enumerate(tokens)))}


def _add_special(tok: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == CONTROL
    ]
    plain = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == USER_DEFINED
    ]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
