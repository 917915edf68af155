"""The requests a server runs once its model is loaded, so that the first user request pays no first-call
costs (kernel compiles, allocator growth)."""

from __future__ import annotations

from ember_engine.sample.sampling_params import SamplingParams


def warm_up(engine) -> None:  # engine: LLMEngine
    """Run representative batches (a long prompt chunk, a batch of decodes) so the first user request
    pays no first-call costs, then forget them."""
    vocab = engine.model_config.vocab_size
    # Every warm-up request fits the context, however short the user or the cache made it: a prompt of at
    # least one token and at least one token generated.
    steps = min(4, engine.max_model_len - 1)
    if steps < 1:
        return  # a context of one token: no request can run, so there is nothing to warm
    room = engine.max_model_len - steps
    long_len = max(1, min(engine.config.max_num_batched_tokens, room, 1024))
    short_len = min(8, room)
    prompts = [[10 + (i * 7919) % (vocab - 10) for i in range(long_len)]]
    prompts += [
        [10 + (i * 104729 + j) % (vocab - 10) for j in range(short_len)]
        for i in range(min(engine.config.max_num_seqs, 8))
    ]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=steps, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_counters()
