"""Tools outside the runtime path: `ember make-test-model`, `ember make-spec-pair` (the trained pair)
and `ember demo`."""
