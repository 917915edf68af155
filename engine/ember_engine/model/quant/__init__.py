"""Quantized weights: the schemes (`fp8`, `w8a16`, `w4a16`), their linear layers, and the checkpoint
formats they load from (compressed-tensors, Hugging Face `fp8`) or are made from at load (online)."""
