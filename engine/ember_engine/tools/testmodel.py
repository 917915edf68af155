"""Test checkpoints: Llama-architecture models with random weights and a real, locally trained tokenizer.

The directory looks exactly like a downloaded Hugging Face checkpoint, so the same loading code serves
real models and these. The tokenizer is a byte-level BPE trained on the Python standard library's own
sources (present on every machine with Python), which makes it deterministic and offline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 4096
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Enough source text for a stable 4k-token vocabulary while training in a couple of seconds.
_CORPUS_BYTES = 3_000_000


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


SIZES = {
    # About 1.6M parameters, grouped-query attention (4 query heads share 2 KV heads).
    "tiny": ModelSize(128, 256, 4, 4, 2, 2048),
    # About 57M parameters, for CPU benchmarks.
    "small": ModelSize(768, 2048, 8, 12, 4, 2048),
}


def corpus_files() -> list[Path]:
    """The standard library's top-level modules, sorted, until the corpus budget is reached."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= _CORPUS_BYTES:
            break
    return files


def train_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer(directory: Path) -> dict[str, int]:
    tok = train_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )
    return ids


def llama_config(size: ModelSize, ids: dict[str, int], tie_word_embeddings: bool = False) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "head_dim": size.hidden_size // size.num_attention_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def random_llama_weights(config: dict, seed: int) -> dict:
    """Random weights with Hugging Face Llama tensor names; norms perturbed so that a mis-loaded
    norm weight changes the output (an all-ones norm would hide it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(h, std=0.1)

    w = {"model.embed_tokens.weight": normal(v, h, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal(q_out, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, q_out, std=q_out**-0.5)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=inter**-0.5)
    w["model.norm.weight"] = norm_weight()
    if not config["tie_word_embeddings"]:
        # Scaled so logits spread over a few units: greedy choices are clear, not near-ties.
        w["lm_head.weight"] = normal(v, h, std=3.0 * h**-0.5)
    return {k: t.contiguous() for k, t in w.items()}


def make_test_model(
    directory: str | Path, size: str | ModelSize = "tiny", seed: int = 0, force: bool = False
) -> Path:
    """Write a checkpoint of a named size (`SIZES`) or of `size` itself; refuses a non-empty directory
    unless force."""
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is not a directory")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty (use --force to overwrite)")
        for entry in out.iterdir():  # its contents: a link to a directory stays a link
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import save_file

    ids = write_tokenizer(out)
    config = llama_config(SIZES[size] if isinstance(size, str) else size, ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids["<|end|>"]], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(random_llama_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only: readable as the rest
    return out


def checkpoint_digest(directory: str | Path) -> str:
    """A digest of every file in a checkpoint, to show two builds are identical."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`ember make-test-model`."""
    p.add_argument("dir", help="output directory")
    p.add_argument(
        "--size", default="tiny", choices=["tiny", "small"], help="tiny (~1.6M params) or small (~57M)"
    )
    p.add_argument("--seed", type=_seed, default=0, help="weight seed, 0 to 2**64 - 1 (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty directory")


def _seed(text: str) -> int:
    seed = int(text)
    if not 0 <= seed < 2**64:  # what torch's generators take
        raise argparse.ArgumentTypeError(f"must be 0 to 2**64 - 1, not {text}")
    return seed


def main(args: argparse.Namespace) -> int:
    try:
        out = make_test_model(args.dir, size=args.size, seed=args.seed, force=args.force)
    except OSError as exc:  # not empty, not a directory, not writable
        print(f"ember make-test-model: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a {args.size} test checkpoint to {out}")
    return 0
