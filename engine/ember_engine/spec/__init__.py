"""Speculative decoding: `SpecDecoder` (plan, propose, verify, trim, stats), the draft-model and n-gram
proposers, and the adaptive on/off controller."""
