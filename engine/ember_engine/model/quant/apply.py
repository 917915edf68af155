"""Putting a scheme into a model: swapping its projections for quantized layers, either empty ones that
a quantized checkpoint fills (`QuantCollector`) or ones quantized from the loaded full-precision weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember_engine.model.parallel import INPUT_SPLIT
from ember_engine.model.quant import bnb, gptq, modelopt, rank_split
from ember_engine.model.quant.checkpoint import canonical, decode
from ember_engine.model.quant.codebook_linear import CodebookLinear
from ember_engine.model.quant.fp4_linear import Fp4Linear
from ember_engine.model.quant.fp8_linear import Fp8Linear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear, W8A8Linear
from ember_engine.model.quant.layer import QuantLinear
from ember_engine.model.quant.layer_specs import checkpoint_parts, layer_spec
from ember_engine.model.quant.linear import make_layer, quantize_linear
from ember_engine.model.quant.rotations import OutputRotations, RotationMatrices
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import QuantSpec
from ember_engine.model.quant.tensor_checks import finite_scales, in_file, misfit
from ember_engine.model.quant.w4a8_linear import W4Fp8Linear

# The decoder's projections; embeddings and norms keep the model dtype, and so does the LM head unless a
# compressed-tensors config (or GPTQ's `lm_head: true`) quantizes it (`HEAD`).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
HEAD = "lm_head"
_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
# `quant_method: fp8` tensors under the names ember holds them by: AutoFP8's and vLLM's weight scale (a
# multiplier, as transformers' `weight_scale_inv` is) and transformers' static input scale
HF_FP8_NAMES = {"weight_scale": "weight_scale_inv", "activation_scale": "input_scale"}


def _projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    found = []
    for module in model.modules():
        for name in PROJECTIONS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                found.append((module, name, child))
    return found


def prepare(model: nn.Module, spec: QuantSpec) -> None:
    """Replace every projection the checkpoint holds quantized by an empty quantized layer of its scheme
    and shape (before loading); the others stay full-precision layers, loaded as they are."""
    parents = {id(m): n for n, m in model.named_modules()}
    for parent, name, linear in _projections(model):
        held = layer_spec(spec, f"{parents[id(parent)]}.{name}")
        if held is None:
            continue
        size = getattr(getattr(model, "shard", None), "size", 1)
        rank_split.check_groups(held.scheme, held.group_size, name, linear.in_features, size)
        layer = _empty(held, linear.in_features, linear.out_features, linear.bias is not None, linear.weight)
        setattr(parent, name, layer)
    _prepare_head(model, spec)


def _prepare_head(model: nn.Module, spec: QuantSpec) -> None:
    """The LM head as an empty quantized layer where the checkpoint holds it quantized; a head tied to the
    embeddings (which stay in the model dtype) is refused."""
    held, head = spec.layer_spec(HEAD), getattr(model, HEAD, None)
    if held is None or head is None:
        return
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise UnsupportedQuantizationError(
            f"{HEAD}: the checkpoint's quantization config holds it in {held.scheme}, but tie_word_embeddings "
            "ties it to embed_tokens, which ember keeps in the model dtype"
        )
    if getattr(getattr(model, "shard", None), "size", 1) > 1:  # split: held dequantized (`rank_split.py`)
        return
    rows, columns = head.weight.shape
    setattr(model, HEAD, _empty(held, columns, rows, False, head.weight))


def _weight_scales(
    layer: QuantLinear, offset: int, rows: int, tensors: dict[str, torch.Tensor], projection: str
) -> None:
    """The weight's scales beside `set_rows`' (NVFP4's global scale, W4A8_AWQ's outer one, a code table)."""
    if "weight_global_scale" in tensors:
        assert isinstance(layer, Fp4Linear)
        layer.set_global_rows(offset, rows, tensors["weight_global_scale"])
    if "weight_scale_2" in tensors:  # W4A8_AWQ's (NVFP4's become weight_global_scale)
        assert isinstance(layer, W4Fp8Linear)
        layer.set_outer_rows(offset, rows, tensors["weight_scale_2"])
    if "weight_quant_map" in tensors:
        assert isinstance(layer, CodebookLinear)
        layer.set_code(tensors["weight_quant_map"], projection)


def _empty(
    held: QuantSpec, in_features: int, out_features: int, bias: bool, like: torch.Tensor
) -> QuantLinear:
    """An empty quantized layer of `held`'s scheme, in the dtype and on the device of weight `like`."""
    layer = make_layer(
        held.scheme,
        in_features,
        out_features,
        bias,
        like.dtype,
        held.group_size,
        zero_points=held.zero_points,
        outlier_threshold=held.outlier_threshold,
        float_zeros=held.float_zeros,
        input_quant=held.input_quant,
    )
    if held.activation_ub:
        assert isinstance(layer, Fp8Linear)
        layer.activation_ub = held.activation_ub
    return layer.to(like.device)


@torch.no_grad()
def quantize_model(model: nn.Module, spec: QuantSpec, tp: Any = None) -> None:
    """Quantize every projection of a loaded full-precision model in place (online quantization). On a
    tensor-parallel rank (`tp`, size > 1) the projections split by input columns (`parallel.INPUT_SPLIT`) are
    quantized as the whole model's are: a scale per output row from the row's largest value over every
    rank, and groups (or tiles) of input columns that lie within a rank's columns, else refused."""
    split = tp is not None and tp.size > 1
    for parent, name, linear in _projections(model):
        row_max = None
        if split and name in INPUT_SPLIT:
            rank_split.check_groups(spec.scheme, spec.group_size, name, linear.in_features, tp.size)
            if not spec.group_size:
                row_max = tp.max_over_ranks(linear.weight.detach().abs().amax(dim=1).float())
        setattr(parent, name, quantize_linear(linear, spec.scheme, spec.group_size, row_max))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (the RoPE tables too), a tied weight counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


class QuantCollector:
    """Gathers each quantized projection's checkpoint tensors as the loader meets them and places the
    decoded weight once a projection's set is complete."""

    def __init__(self, model: nn.Module, spec: QuantSpec) -> None:
        self.spec = spec
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        self.specs: dict[str, QuantSpec] = {}  # each layer's own scheme (a mixed checkpoint's group)
        for n in self.layers:
            held = layer_spec(spec, n)
            assert held is not None, n
            self.specs[n] = held
        self.pending: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
        self.names: dict[tuple[str, int | None], str] = {}  # the checkpoint projection of each key
        self.offsets: dict[tuple[str, int | None], int] = {}
        self.rows: dict[tuple[str, int | None], int] = {}  # each part's output rows, once placed
        self.matrices = RotationMatrices(spec.rotations)
        self.done: set[tuple[str, int | None]] = set()
        self.spelled: dict[str, str] = {}  # a tensor's name in this checkpoint, where it is not ember's
        self.split = rank_split.RankSplit(model, spec, self.layers, self.specs)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name with one dot between its module and its own name (bitsandbytes
        files a weight's state under `weight.absmax` and the like)."""
        return bnb.flat_suffix(name) if self.spec.format == "bitsandbytes" else name

    def take(
        self,
        name: str,
        target: str,
        part: int | None,
        offset: int,
        tensor_slice: Any,
        rows: int | None = None,
    ) -> bool:
        """Claim checkpoint tensor `name` (mapped to `target`, merged part `part` of `rows` rows at row `offset`) if it
        belongs to a quantized layer; False leaves it to the ordinary loader."""
        if self.matrices.take(name, tensor_slice):
            return True
        module, _, suffix = target.rpartition(".")
        if module not in self.specs or suffix == "bias":
            return False
        spec = self.specs[module]
        if spec.format == "hf-fp8" and suffix in HF_FP8_NAMES:  # AutoFP8's and vLLM's, transformers'
            value = tensor_slice[...]  # checked here, where its name is the file's
            finite_scales({suffix: value}, name.rpartition(".")[0])
            one = value.float().reshape(-1)
            if suffix == "activation_scale" and not (
                one.numel() == 1 and bool(torch.isfinite(one).all()) and one.item() > 0
            ):
                raise UnsupportedQuantizationError(
                    f"{name}: must be one positive finite number (static per tensor), found {one.tolist()[:4]}"
                )
            self.spelled[HF_FP8_NAMES[suffix]] = suffix
            suffix = HF_FP8_NAMES[suffix]
        if suffix == "weight_format" and spec.format == "bitsandbytes-8bit":
            layout = tensor_slice[...].reshape(-1).tolist()  # one number, 0-d
            if layout != [0]:  # bitsandbytes' row-major layout
                raise UnsupportedQuantizationError(
                    f"{name}: weight_format {layout} is not supported; supported: 0 (row)"
                )
            return True
        if suffix == "pre_quant_scale" and spec.format == modelopt.METHOD and module in self.layers:
            factors = self.split.columns(name.rpartition(".")[0], tensor_slice[:])
            self.layers[module].set_input_smooth(factors, name.rpartition(".")[0])
            return True
        if suffix not in spec.required() and suffix not in ("input_scale", "weight_zero_point", "g_idx"):
            raise UnsupportedQuantizationError(f"unexpected tensor {name!r} in a {spec.format} checkpoint")
        key = (module, part)
        if suffix == "weight_zero_point" and suffix not in spec.required():
            zp = tensor_slice[:]
            if torch.count_nonzero(zp):
                raise UnsupportedQuantizationError(
                    f"{name}: nonzero zero points (asymmetric) are not supported"
                )
            return True
        if suffix == "input_scale" and suffix not in spec.required():
            if spec.scheme == "w8a16-fp8":
                raise UnsupportedQuantizationError(
                    f"{name}: an activation scale in a checkpoint whose config quantizes no activations "
                    "(FP8 weights only)"
                )
            return True  # dynamic activations: a calibrated scale is not used
        if suffix == "g_idx" and (suffix not in spec.required() or self.split.size > 1):
            order = gptq.input_order(spec, name, tensor_slice[:])  # without desc_act: refuses a reordering
            if order is not None:  # a rank cannot hold reordered columns
                raise UnsupportedQuantizationError(
                    f"{name}: GPTQ's activation order reorders the input columns; not supported with "
                    "tensor_parallel_size > 1"
                )
            return True
        self.pending.setdefault(key, {})[suffix] = tensor_slice[...]  # 0-d: a scale per tensor
        self.offsets[key] = offset
        projection = self.names[key] = name.rpartition(".")[0]
        if spec.required() <= self.pending[key].keys():
            given = self.pending.pop(key)
            finite_scales(given, projection)  # as the file names them
            tensors = canonical(spec, given, projection)
            if tensors is not given:  # renamed or derived (ModelOpt's, the MX formats'): those too
                finite_scales(tensors, projection)
            if module not in self.layers:  # a split's LM head, held dequantized
                place = lambda head: _weight_scales(head, 0, head.out_features, tensors, projection)  # noqa: E731
                self.split.head_rows(spec, decode(spec, tensors, projection), _empty, place)
                self.done.add(key)
                return True
            layer = self.layers[module]
            if "g_idx" in tensors:
                layer.set_input_order(gptq.input_order(spec, projection, tensors["g_idx"]), projection)
            decoded = decode(spec, tensors, projection)
            try:
                weight, scale, zero = self.split.cut(projection, layer.in_features, decoded)
                expected = layer.out_features if rows is None else rows  # a merged layer's part: its own
                if weight.shape[0] != expected:
                    raise UnsupportedQuantizationError(
                        f"{projection}: {weight.shape[0]} output rows, but the config gives "
                        f"{'that part' if rows is not None else 'that layer'} {expected}"
                    )
                layer.set_rows(offset, weight.to(layer.weight_scale.device), scale)
                if zero is not None:
                    assert isinstance(layer, (Int4Linear, Int8Linear))
                    layer.set_zero_rows(offset, zero)
            except RuntimeError as e:  # a shape the config's layer cannot hold, but not a device's fault
                if isinstance(e, torch.OutOfMemoryError) or type(e).__name__ == "AcceleratorError":
                    raise
                raise UnsupportedQuantizationError(misfit(spec, tensors, projection, layer, e)) from e
            self.rows[key] = weight.shape[0]
            _weight_scales(layer, offset, weight.shape[0], tensors, projection)
            if "input_global_scale" in tensors:
                assert isinstance(layer, Fp4Linear)
                layer.set_input_global(
                    tensors["input_global_scale"], projection, spec.format == modelopt.METHOD
                )
            if "input_scale" in tensors:
                assert isinstance(layer, (Fp8Linear, W8A8Linear, Fp4Linear, W4Fp8Linear))
                layer.set_input_scale(tensors["input_scale"], projection)
            self.done.add(key)
        return True

    def missing(self) -> list[str]:
        """Projections the checkpoint did not provide, and the tensors of those it gave in part."""
        absent = [m for m in self.specs if m not in self.layers and (m, None) not in self.done]
        for module in self.layers:
            parts = _PARTS.get(module.rsplit(".", 1)[-1])
            keys = [(module, None)] if parts is None else [(module, i) for i in range(parts)]
            for key in keys:
                if key in self.done:
                    continue
                if key in self.pending:  # some of its tensors came: name the others
                    given = self.pending[key].keys()
                    needed = self.specs[module].required() - given
                    absent += [f"{self.names[key]}.{in_file(self.spelled.get(t, t))}" for t in sorted(needed)]
                else:
                    absent.append(f"{module}[{key[1]}]" if key[1] is not None else module)
        return absent

    def finish(self, model: nn.Module) -> None:
        """Give each quantized layer the rotations the config applies to it as the model runs (`rotations.py`);
        the parts of a merged layer must share its input's, and a layer in full precision the config rotates
        is refused by name. A merged layer's parts must be smoothed alike (AWQ's `pre_quant_scale`)."""
        for name, layer in self.layers.items():
            layer.check_input_smooth(checkpoint_parts(name))
        if not self.spec.rotations:
            return
        for name, layer in self.layers.items():
            parts = checkpoint_parts(name)
            short = ", ".join(p.rpartition(".")[2] for p in parts)
            inputs = {
                tuple(r for r in self.spec.rotations if r.location == "input" and r.applies_to(p))
                for p in parts
            }
            outputs = [
                [r for r in self.spec.rotations if r.location == "output" and r.applies_to(p)] for p in parts
            ]
            if len(inputs) > 1 or len(next(iter(inputs))) > 1 or any(len(o) > 1 for o in outputs):
                raise UnsupportedQuantizationError(
                    f"{name}: the transform_config rotates the inputs of {short} unlike each other, or one place "
                    "twice; ember runs them as one layer, with one rotation at its input and one per part at its "
                    "output"
                )
            device = layer.weight_scale.device
            (held,) = inputs
            if held:
                layer.input_rotation = self.matrices.rotation(held[0], layer.in_features, name).to(device)
            if not any(outputs):
                continue
            if not all(outputs):
                raise UnsupportedQuantizationError(
                    f"{name}: the transform_config rotates the outputs of some of {short} only; ember runs them "
                    "as one layer, so they must all be rotated or none"
                )
            keys = [(name, i if len(parts) > 1 else None) for i in range(len(parts))]
            segments = sorted(zip(keys, outputs, parts, strict=True), key=lambda s: self.offsets[s[0]])
            layer.output_rotation = OutputRotations(
                [(self.rows[k], self.matrices.rotation(o[0], self.rows[k], p)) for k, o, p in segments]
            ).to(device)
        for name, module in model.named_modules():  # a layer left in full precision
            if isinstance(module, QuantLinear) or name.rpartition(".")[2] not in (*PROJECTIONS, HEAD):
                continue
            if any(r.applies_to(p) for r in self.spec.rotations for p in checkpoint_parts(name)):
                raise UnsupportedQuantizationError(
                    f"{name}: the transform_config rotates it as the model runs, but it is in full precision; "
                    "ember applies run-time rotations to quantized layers only"
                )
