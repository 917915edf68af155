"""ember's Kubernetes operator: InferenceService -> engine pods, warm pool, autoscaling, policy."""

__version__ = "0.1.0"
