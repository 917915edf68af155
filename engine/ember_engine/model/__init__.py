"""The model side: Llama-family decoders, the checkpoint loader and model config, the model runner,
and attention (torch reference and Triton kernels) with its per-step forward context."""
