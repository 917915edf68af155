"""Tensor parallelism's processes: the rendezvous and process groups (`group`), the one message per step
that rank 0 broadcasts (`step_channel`), and the worker ranks the engine starts and watches (`workers`)."""
