"""The workload of `ember bench serve`: when each request is sent (`arrival_times`) and what it asks
(`make_prompts`, random English words, so no tokenizer is needed on the client)."""

from __future__ import annotations

import math
import random

# Short, common English words: about one token each in the usual BPE vocabularies, so a prompt of N words
# is roughly N tokens on any server without the client needing the model's tokenizer.
_VOCABULARY = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but first one their its new after who they two her she been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made"
)
WORDS = _VOCABULARY.split()


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: gamma-distributed gaps with shape `burstiness` and mean
    1/rate (coefficient of variation 1/sqrt(burstiness): 1 is a Poisson process, infinity a steady beat).
    An infinite rate sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += 1.0 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def make_prompts(
    n: int,
    rng: random.Random,
    input_len: tuple[int, int],
    prefix_len: int = 0,
    long_fraction: float = 0.0,
    long_factor: int = 1,
) -> list[str]:
    """Random-word prompts of `input_len` words after a common prefix of `prefix_len` words; a random
    `long_fraction` of them (exactly that share, rounded) is `long_factor` times longer past the prefix."""
    prefix = " ".join(rng.choices(WORDS, k=prefix_len))
    long = set(rng.sample(range(n), round(long_fraction * n)))
    prompts = []
    for i in range(n):
        words = rng.randint(*input_len) * (long_factor if i in long else 1)
        prompts.append(" ".join(filter(None, [prefix, *rng.choices(WORDS, k=words)])))
    return prompts
