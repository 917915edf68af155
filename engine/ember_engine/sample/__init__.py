"""Sampling: `SamplingParams`, the batched sampler (temperature, top-k/p, min-p, penalties, seeds,
logprobs) and the exact rejection sampler that verifies speculative proposals."""
