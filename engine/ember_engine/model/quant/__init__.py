"""Quantized weights: the schemes (`fp8`, `w8a16`, `w4a16`, `w8a8`, `bnb-nf4`; from a checkpoint also
`nvfp4a16`, `nvfp4`, `bnb-fp4`), their linear layers, and the checkpoint formats they load from
(compressed-tensors, Hugging Face `fp8`, GPTQ, AWQ, bitsandbytes) or are made from at load (online)."""
