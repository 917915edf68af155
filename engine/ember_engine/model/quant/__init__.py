"""Quantized weights: the schemes (README "Quantization"), their linear layers, and the checkpoint formats
they load from (compressed-tensors, HF `fp8`, GPTQ, AWQ, bitsandbytes, ModelOpt, Quark) or online."""
