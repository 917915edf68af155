"""The engine core: the step loop (`LLMEngine`), scheduler, paged KV-cache block manager, requests,
output processing and detokenization, the tokenizer, engine configuration and output types."""
