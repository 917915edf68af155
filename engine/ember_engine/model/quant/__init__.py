"""Quantized weights: the schemes (README "Quantization"), their linear layers, and the checkpoint formats
they load from (compressed-tensors, Hugging Face `fp8`, GPTQ, AWQ, bitsandbytes, ModelOpt) or online."""
