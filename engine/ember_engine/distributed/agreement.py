"""What every node of a multi-node group must agree on, and the refusal that names what differs.

Each node of a group is started by its own `ember serve` command, and each builds its ranks from its own
options: a node started otherwise than node 0 would load other weights, quantize them otherwise or run
other collectives (an FP8 KV cache's calibration forwards, which node 0 never joins, hang the group; another
quantization or checkpoint serves wrong text). So at the rendezvous each rank publishes its node's
identity (`node_identity`) and rank 0 compares every one with its own (`disagreement`) before any
model loads.

Compared: the options that decide what a rank computes or which collectives it runs. Not compared: the
options only rank 0 uses (tokenizer, scheduling policy, prefix caching, the n-gram proposer's settings,
the draft model, which runs on rank 0), the cache size options (every rank takes the smallest cache any
rank fits: one all-reduce), and where each node is (node rank, rendezvous address and port, the model's
path). A checkpoint is known by its config.json and quantization config files (their parsed contents)
and by each weight file's name, size and the digest of its last `TAIL_BYTES` (not of all its bytes,
which can be hundreds of GB).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember_engine.core.config import EngineConfig

# The options compared, as EngineConfig names them (plus `device`, the device type a node runs on).
COMPARED_OPTIONS = (
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "block_size",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "tensor_parallel_size",
    "nnodes",
    "seed",
    "speculative_method",
    "num_speculative_tokens",
)
# Files beside config.json that can hold a checkpoint's quantization config (`read_quantization_config`).
QUANT_CONFIG_FILES = ("hf_quant_config.json", "quantize_config.json", "quant_config.json")
TAIL_BYTES = 64 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def node_identity(config: EngineConfig, device_type: str) -> dict[str, Any]:
    """This node's options and checkpoint, as compared with node 0's (JSON-serializable)."""
    identity: dict[str, Any] = {name: getattr(config, name) for name in COMPARED_OPTIONS}
    identity["speculative_method"] = config.speculation
    identity["num_speculative_tokens"] = config.speculative_tokens
    identity["device"] = device_type
    identity.update(checkpoint_identity(config.model))
    return identity


def checkpoint_identity(model: str) -> dict[str, Any]:
    """The checkpoint at `model` (a directory, a GGUF file's materialized directory, or a file): digests
    of its config files and of its weight files' names, sizes and tails; what cannot be read is named."""
    path = Path(model)
    try:
        config, weights = _config_digest(path), _weights_digest(path)
    except (OSError, ValueError) as exc:
        unreadable = f"unreadable ({type(exc).__name__}: {exc})"
        return {"checkpoint config.json": unreadable, "checkpoint weights": unreadable}
    return {"checkpoint config.json": config, "checkpoint weights": weights}


def disagreement(identities: Sequence[tuple[int, dict[str, Any]]]) -> str | None:
    """Given (node, identity) for every rank, node 0's first: None where every node agrees with node 0,
    else a message naming, for each node that differs, each option and both values."""
    (leader_node, leader), *others = identities
    lines: list[str] = []
    seen: set[int] = set()
    for node, identity in others:
        if node in seen:
            continue
        differences = [
            f"{name}: node {leader_node} has {leader.get(name)!r}, node {node} has {identity.get(name)!r}"
            for name in sorted(set(leader) | set(identity), key=_order)
            if leader.get(name) != identity.get(name)
        ]
        if differences:
            seen.add(node)
            lines.append(f"node {node} was not started as node {leader_node} was: " + "; ".join(differences))
    if not lines:
        return None
    return "every node must be given the same options and checkpoint: " + "; ".join(lines)


def _order(name: str) -> tuple[int, str]:
    known = (*COMPARED_OPTIONS, "device")
    return (known.index(name), name) if name in known else (len(known), name)


def _config_digest(path: Path) -> str:
    directory = path if path.is_dir() else path.parent
    contents: dict[str, Any] = {}
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        if "gguf_file" in config:  # a GGUF file's directory: where the file lies differs by node
            config["gguf_file"] = Path(config["gguf_file"]).name
        contents["config.json"] = config
    for name in QUANT_CONFIG_FILES:
        if (directory / name).exists():
            contents[name] = json.loads((directory / name).read_text())
    return _digest(json.dumps(contents, sort_keys=True))


def _weights_digest(path: Path) -> str:
    if path.is_dir():
        gguf = json.loads((path / "config.json").read_text()).get("gguf_file")
        files = (
            [Path(gguf)] if gguf else sorted(p for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))
        )
    else:
        files = [path]
    if not files:
        raise ValueError(f"no weight files in {path}")
    parts, total = [], 0
    for file in files:
        size = file.stat().st_size
        total += size
        with file.open("rb") as f:
            f.seek(max(0, size - TAIL_BYTES))
            parts.append(f"{file.name}:{size}:{hashlib.sha256(f.read()).hexdigest()}")
    digest = _digest("\n".join(parts))
    return f"{len(files)} file{'s' if len(files) > 1 else ''}, {total} bytes, {digest}"


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
