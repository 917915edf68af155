"""ember's serving engine: paged KV cache, prefix caching, continuous batching, Triton kernels.

Heavy modules (torch) load on first use so that `import ember_engine` and the `ember` command stay cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ember_engine.core.outputs import CompletionOutput, RequestOutput
    from ember_engine.llm import LLM
    from ember_engine.sample.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "ember_engine.llm",
    "RequestOutput": "ember_engine.core.outputs",
    "CompletionOutput": "ember_engine.core.outputs",
    "SamplingParams": "ember_engine.sample.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ember_engine' has no attribute {name!r}")
