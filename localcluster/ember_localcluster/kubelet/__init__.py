"""The process kubelet: it runs each Pod bound to its node as local processes, with volumes, probes,
restarts, preStop hooks, graceful deletion and pod status, one worker per pod."""
