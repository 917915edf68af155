"""Every Triton launch goes through `launch`, which keeps a ledger of the kernel variants launched so far.

Triton compiles a kernel once per variant: the constexpr values, each tensor's dtype and 16-byte
alignment, and, for an integer argument not marked `do_not_specialize`, whether it is 1 and whether it is
a multiple of 16. The ledger computes that key for each launch; a key not seen before is a compilation
(on a GPU, a stall of about a second). The engine launches every variant it can reach while warming up,
so a variant first seen while serving is a defect, and `KernelLedger.compiles` counts them (under
TRITON_INTERPRET=1 too, where nothing is really compiled)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0)
    return (type(value).__name__,)


@dataclass(slots=True)
class KernelLedger:
    variants: dict[str, set[tuple[Any, ...]]] = field(default_factory=dict)
    compiles: int = 0  # variants first launched (each a compilation on a GPU)

    def record(
        self, name: str, args: Sequence[tuple[str, Any]], constexprs: dict[str, Any], varying: Sequence[str]
    ) -> bool:
        """Record one launch; True when it is a variant not launched before."""
        key = tuple((n, _spec(v)) for n, v in args if n not in varying)
        key += tuple(sorted(constexprs.items()))
        seen = self.variants.setdefault(name, set())
        if key in seen:
            return False
        seen.add(key)
        self.compiles += 1
        return True


LEDGER = KernelLedger()
_VARYING: dict[str, tuple[str, ...]] = {}


def jit(*, do_not_specialize: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """`triton.jit`, remembering which integer arguments the kernel does not specialize on (the
    interpreter keeps no record of them)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        _VARYING[fn.__name__] = tuple(do_not_specialize)
        return triton.jit(do_not_specialize=list(do_not_specialize))(fn)

    return wrap


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """`kernel[grid](*args, **constexprs)`, recorded in the ledger first."""
    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
    LEDGER.record(name, list(zip(kernel.arg_names, args, strict=False)), constexprs, _VARYING.get(name, ()))
    kernel[grid](*args, **constexprs)
