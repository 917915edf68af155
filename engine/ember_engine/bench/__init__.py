"""`ember bench throughput|serve|spec`: benchmarks that measure ratios side by side in one run. Never
imported by the runtime path."""
