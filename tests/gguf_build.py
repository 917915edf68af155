"""Writes a test checkpoint as a GGUF file, as llama.cpp's converter lays a llama model out, and what
transformers computes from that file (run as a script: `python gguf_build.py SRC DST PRESET`).

DST gets `model.gguf`, the source's tokenizer files beside it, and `oracle.pt`: the logits of 8 fixed
prompts and the greedy tokens after 6 of them, from transformers loading the GGUF file
(`from_pretrained(DST, gguf_file=...)`, which dequantizes every tensor with the `gguf` package and puts
the q and k rows back in order), and the source model's own logits. The tensors are quantized by the
`gguf` package; it writes no K-quants, so the MIXED preset's Q6_K tensor holds random 6-bit values under
scales of a plausible size.

PRESET: F32, F16 (matrices F16, norms F32), Q8_0, Q4_0 (every matrix in that type), MIXED (q and k Q4_0,
v and o Q8_0, gate and up Q4_1, down Q5_0 but layer 0's Q6_K, embeddings Q8_0, LM head F16).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

PROMPTS, PROMPT_LENGTH, GREEDY_PROMPTS, GREEDY_TOKENS = 8, 12, 6, 12
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q8_0"}
MIXED |= {"ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_0", "token_embd": "Q8_0", "output": "F16"}


def gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        return f"blk.{layer}.{_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
        name, "output.weight" if name == "lm_head.weight" else name
    )


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def kind_of(preset: str, name: str) -> str:
    short = name.split(".")[-2]
    if preset == "F32" or short.endswith("norm"):
        return "F32"
    if preset == "MIXED":
        return "Q6_K" if name == "blk.0.ffn_down.weight" else MIXED[short]
    return preset


def random_q6_k(rows: int, columns: int, seed: int) -> np.ndarray:
    """Q6_K blocks (256 values: 128 bytes of low bits, 64 of high bits, 16 int8 scales, a float16 scale)
    of random 6-bit values, the scales giving values about as large as the test model's weights."""
    rng = np.random.default_rng(seed)
    blocks = rows * columns // 256
    low = rng.integers(0, 256, (blocks, 192), dtype=np.uint8)
    scales = rng.integers(1, 9, (blocks, 16), dtype=np.int8).view(np.uint8)
    d = np.full((blocks, 1), 1e-4, dtype=np.float16).view(np.uint8)
    return np.concatenate([low, scales, d], axis=1).reshape(rows, -1)


def write(src: Path, path: Path, preset: str) -> None:
    import gguf
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    config = __import__("json").loads((src / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(config["hidden_size"] // heads)
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tok.id_to_token(i) for i in range(tok.get_vocab_size())])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    for i, (name, tensor) in enumerate(sorted(load_file(str(src / "model.safetensors")).items())):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = tensor.to(torch.float32).numpy()
        if name.endswith("q_proj.weight"):
            array = permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = permute(array, kv_heads)
        target = gguf_name(name)
        kind = kind_of(preset, target)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "Q6_K":
            w.add_tensor(target, random_q6_k(*array.shape, seed=i), raw_dtype=qtype)
        elif kind in ("F32", "F16"):
            w.add_tensor(target, array.astype(np.float16 if kind == "F16" else np.float32))
        else:
            w.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(src: Path, dst: Path, preset: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    dst.mkdir(parents=True)
    write(src, dst / "model.gguf", preset)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 4000, (PROMPT_LENGTH + i,), generator=gen).tolist() for i in range(PROMPTS)]
    theirs = AutoModelForCausalLM.from_pretrained(dst, gguf_file="model.gguf", dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = [theirs(torch.tensor([p])).logits[0] for p in prompts]
        source_logits = [source(torch.tensor([p])).logits[0] for p in prompts]
        greedy = []
        for p in prompts[:GREEDY_PROMPTS]:
            ids = theirs.generate(
                torch.tensor([p]),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            greedy.append(ids[0, len(p) :].tolist())
    torch.save(
        {"prompts": prompts, "logits": logits, "greedy": greedy, "source_logits": source_logits},
        dst / "oracle.pt",
    )


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
