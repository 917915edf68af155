"""`ember serve`: the OpenAI-compatible HTTP API, its request models and response formatting, admission
(load shedding, queue-wait forecast, policy file), fallback, draining and Prometheus metrics."""
