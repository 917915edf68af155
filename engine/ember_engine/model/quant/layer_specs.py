"""Which scheme each of ember's projections holds: a merged one (q/k/v, gate/up) runs as one layer, so the
checkpoint's parts it holds must be quantized alike (parts that differ are refused by name)."""

from __future__ import annotations

from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import QuantSpec

# The checkpoint's layers a merged projection holds (the others are one layer each, named alike).
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def layer_spec(spec: QuantSpec, module: str) -> QuantSpec | None:
    """The scheme the checkpoint holds projection `module` (e.g. "model.layers.0.self_attn.qkv_proj") in,
    None for full precision; every part of a merged one alike (parts that differ are refused by name)."""
    parent = module.rpartition(".")[0]
    held = {part.rpartition(".")[2]: spec.layer_spec(part) for part in checkpoint_parts(module)}
    parts = tuple(held)
    if len(set(held.values())) == 1:
        return held[parts[0]]

    def listed(names: list[str], what: str) -> str:
        return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {what}"

    runs = f"ember runs {', '.join(parts)} as one layer, so they must be quantized alike"
    if None in held.values():
        full = [p for p, s in held.items() if s is None]
        quantized = [p for p, s in held.items() if s is not None]
        raise UnsupportedQuantizationError(
            f"{parent}: {listed(full, 'left in full precision')} but {listed(quantized, 'quantized')} "
            f"(ignore/targets); {runs}"
        )
    by_scheme: dict[str, list[str]] = {}
    for part, s in held.items():
        assert s is not None
        by_scheme.setdefault(_label(s, set(held.values())), []).append(part)
    fewest, *others = sorted(by_scheme.items(), key=lambda kv: len(kv[1]))
    raise UnsupportedQuantizationError(
        f"{parent}: {listed(fewest[1], fewest[0])} but {'; '.join(listed(ps, s) for s, ps in others)} "
        f"(config groups); {runs}"
    )


def _label(spec: QuantSpec, among: set[QuantSpec | None]) -> str:
    """A group's scheme, told apart from the others' where their scheme names are the same."""
    if all(s.scheme != spec.scheme for s in among if s is not None and s != spec):
        return spec.scheme
    scales = f"groups of {spec.group_size}" if spec.group_size else "per channel"
    static = ", static input scales" if spec.static_input else ""
    static += f", {spec.input_quant} inputs" if spec.input_quant else ""
    return f"{spec.scheme} ({spec.format}, {scales}{static}{', zero points' if spec.zero_points else ''})"


def checkpoint_parts(module: str) -> list[str]:
    """The checkpoint's linear layers ember's layer `module` holds (q/k/v and gate/up merged)."""
    parent, _, name = module.rpartition(".")
    return [f"{parent}.{p}" if parent else p for p in _MERGED.get(name, (name,))]
